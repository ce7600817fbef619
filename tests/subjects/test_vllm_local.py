"""`vllm:local`: vLLM's real Scheduler over a full-attention and a chunked local attention group
(`kvledger/subjects/vllm_local.py`), judged step by step by the scheduling driver, and its zoo.

Needs vllm and einops (`subjects-constraints.txt`); every test skips with the reason without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence, Tuple

import pytest

from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.trace import read
from kvledger.properties.scheduling_driver import SchedulingDriver
from kvledger.properties.subject import SubjectConfig
from kvledger.properties.target import config_of
from kvledger.subjects import vllm_local
from kvledger.subjects.edits import SourceEdit

INSTALLED, VERSION, DETAIL = vllm_local.probe()
pytestmark = pytest.mark.skipif(not INSTALLED, reason=f"vllm is not usable here: {DETAIL}")

PS = 4
C = vllm_local.CHUNK_BLOCKS * PS
CFG = SubjectConfig(num_pages=16, page_size=PS, max_seq_len=48, max_running_req=4)
PROMPT = list(range(100, 118))  # 18 tokens: chunks [0, 8), [8, 16), [16, 18)
TRACES = Path(__file__).parent / "vllm_local_traces"  # `kvledger zoo --subject vllm:local` (fuzz, seed 0)


def _driver(edits: Sequence[SourceEdit] = (), config: SubjectConfig = CFG) -> Tuple[Any, SchedulingDriver]:
    subject = vllm_local.build(config, None, edits)
    return subject, SchedulingDriver(subject, config)


def test_the_local_group_holds_only_the_chunk_of_the_next_position():
    subject, driver = _driver()
    driver.submit(0, PROMPT, 12)
    driver.prefill(64)
    for steps in range(1, 9):
        driver.decode(sample=[7])
        view = subject.view()
        (group,) = view.groups
        assert group.chunk == C and group.window is None
        computed = driver.witness.computed[0]
        assert computed == len(PROMPT) + steps
        local, full = group.requests[0], view.requests[0]
        assert None not in full and len(local) == len(full)
        # vLLM drops at the allocation of a step (remove_skipped_blocks), what precedes the chunk
        # of the position that step starts at; the chunk of the next position is all held
        dropped, start = (computed - 1) // C * C, computed // C * C
        assert local[:dropped] == [None] * dropped
        assert None not in local[start:computed]


def test_a_prefix_hit_in_the_local_group_is_the_chunk_it_ends_in():
    """A second request sharing 12 tokens hits 12: the full group's cached blocks, and in the local
    group null blocks up to the chunk the hit ends in ([8, 12) is cached: vLLM's finder)."""
    subject, driver = _driver()
    driver.submit(0, PROMPT, 8)
    driver.prefill(64)
    driver.submit(1, PROMPT[:12] + [5, 6], 2)
    driver.prefill(64)
    view = subject.view()
    local = view.groups[0].requests[1]
    assert view.requests[1][:12] == view.requests[0][:12]
    assert local[:8] == [None] * 8 and None not in local[8:12]


def test_the_pool_comes_back_when_every_request_ends():
    subject, driver = _driver()
    driver.submit(0, PROMPT, 3)
    driver.submit(1, PROMPT[:10] + [1, 2], 3)
    for _ in range(3):
        driver.prefill(8)
    for _ in range(4):
        driver.decode(sample=[5])
    view = subject.view()
    assert not view.requests and all(not g.requests for g in view.groups)
    assert sorted(view.free) == list(range(1, CFG.num_pages + 1))


def _replay(edits: Sequence[SourceEdit], path: Path) -> None:
    header, ops = read(path)
    _, driver = _driver(edits, config_of(header))
    for op in ops:
        driver.apply(op)


@pytest.mark.parametrize("edit", vllm_local.ZOO, ids=lambda e: e.name)
def test_zoo_bug_is_caught_and_the_clean_subject_passes(edit: SourceEdit):
    """Each planted bug's minimized trace is a finding of the judge's KV-provenance clause with the
    bug (the chunk the next position reads lost its KV), and replays clean without it."""
    path = TRACES / f"{edit.name}.jsonl"
    with pytest.raises(Finding) as found:
        _replay([edit], path)
    assert found.value.kind == "7-kv-provenance", found.value
    _replay([], path)
