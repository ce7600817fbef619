"""`sglang:spec`: SGLang 0.5.23's speculative decoding allocation (NGRAM, 4 draft tokens, page 4) as
a subject on the call-level protocol's speculation path: its lengths step by step as SGLang's own
functions compute them, the release of the over-allocated tail, the runtime context kept to the
subject, and its zoo, each bug caught on its minimized trace while the clean subject replays it clean.

Needs the installed sglang (the `# sglang` section of subjects-constraints.txt); every test skips
with the reason when it is absent.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import pytest

from kvledger.properties.subject import SubjectConfig
from kvledger.properties.subject_driver import SubjectDriver, drive
from kvledger.subjects import parse_spec, sglang, sglang_spec
from kvledger.subjects.edits import SourceEdit, edited_function

CFG = SubjectConfig(num_pages=24, page_size=4, max_seq_len=40, max_running_req=4)
PROMPT = [1, 2, 3, 1, 2, 3, 0, 1, 2, 3]  # 10 tokens: two full pages and half a page


pytestmark = pytest.mark.usefixtures("sglang_importable")


def _build(config: SubjectConfig = CFG, edits: Sequence[SourceEdit] = ()) -> sglang_spec.SpecSglangSubject:
    return sglang_spec.build(config, None, edits)


def _lengths(s: sglang_spec.SpecSglangSubject, uid: int) -> Tuple[int, int]:
    kv = s.requests[uid].req.kv
    return kv.kv_allocated_len, kv.kv_committed_len


def test_the_spec_is_listed_and_declares_what_sglang_does():
    spec = parse_spec("sglang:spec")
    assert spec.builtin and spec.page_sizes() == (4,)
    caps = _build().capabilities
    # NGRAM's verify tree: the last token and 3 drafts; the reserve 2 x 4 past kv_committed_len
    assert (caps.spec_tokens, caps.max_ahead, caps.page_size, caps.preempts) == (3, 7, 4, True)
    with pytest.raises(Exception, match="page size 4"):
        _build(SubjectConfig(num_pages=8, page_size=2, max_seq_len=16))


def test_lengths_step_by_step_as_sglang_computes_them():
    """allocated = max(allocated, ceil_page(committed + 8)), committed += accepted + 1 (field-paths.md
    section 8's walk, with NGRAM's 3 drafts)."""
    s = _build()
    d = SubjectDriver(s, CFG)
    d.apply({"op": "submit", "uid": 0, "tokens": PROMPT, "max_tokens": 12})
    d.apply({"op": "prefill", "budget": 64, "sample": [1]})
    assert _lengths(s, 0) == (10, 10)
    walk = [([2], (20, 13)), ([0], (24, 14)), ([3], (24, 18)), ([1], (28, 20))]
    for accept, lengths in walk:
        d.apply({"op": "decode", "sample": [1, 2, 3, 0], "accept": accept})
        assert _lengths(s, 0) == lengths
        view = s.view()
        assert len(view.requests[0]) == lengths[0]  # the row the judge reads: [0, kv_allocated_len)
        assert d.witness.computed[0] == lengths[1] == len(d.witness.tokens[0]) - 1
    assert s.view().counters["free_pages"] == 24 - 7  # 28 positions held, 3 pages of them the tree's


def test_a_release_frees_the_tail_past_the_committed_page():
    s = _build()
    d = SubjectDriver(s, CFG)
    d.apply({"op": "submit", "uid": 0, "tokens": PROMPT, "max_tokens": 12})
    d.apply({"op": "prefill", "budget": 64, "sample": [1]})
    d.apply({"op": "decode", "sample": [1, 2, 3, 0], "accept": [2]})  # allocated 20, committed 13
    d.apply({"op": "finish", "uid": 0})
    view = s.view()
    assert view.requests == {}
    # the tree keeps the committed KV's whole pages (12 positions); everything else is free
    assert view.counters["free_pages"] == 24 - 3 and view.counters["cached_tokens"] == 12


def test_the_speculative_config_stays_with_the_subject():
    """The spec subject publishes its ServerArgs in a context of its own: after its calls, the
    process-wide config the other sglang specs read still has no speculative algorithm."""
    from sglang.srt.runtime_context import get_spec

    s = _build()
    d = SubjectDriver(s, CFG)
    d.apply({"op": "submit", "uid": 0, "tokens": PROMPT, "max_tokens": 4})
    d.apply({"op": "prefill", "budget": 64, "sample": [1]})
    d.apply({"op": "decode", "sample": [1, 2, 3, 0], "accept": [1]})
    assert get_spec().speculative_algorithm is None
    plain = sglang.build(CFG)
    assert plain.capabilities.spec_tokens == 0
    from sglang.srt.mem_cache import allocation

    assert allocation.assign_req_to_token_pool_func is not sglang_spec._assign_rows  # the stub is put back


# -- the zoo ------------------------------------------------------------------------------------------------------
# each bug's trace, minimized by `kvledger zoo --subject sglang:spec` (fuzz seed 0): the pool's pages, max_seq_len
# and request rows, the operations, and what names the bug (two are SGLang's own failures: a page freed twice
# trips its allocator's assertion, a memory check that passes a step the pool cannot serve makes it raise)
Ops = List[Dict[str, Any]]
SCRIPTS: Dict[str, Tuple[int, int, int, Ops, str]] = {
    "sglang-spec-tail-not-freed": (
        12,
        48,
        7,
        [
            {"op": "submit", "uid": 0, "tokens": [2], "max_tokens": 2},
            {"op": "prefill", "budget": 64, "sample": [2]},
            {"op": "decode", "sample": [1], "accept": [3, 2]},
        ],
        "11-over-allocation",
    ),
    "sglang-spec-tail-from-owned": (
        12,
        48,
        7,
        [
            {"op": "submit", "uid": 0, "tokens": [2], "max_tokens": 2},
            {"op": "prefill", "budget": 64, "sample": [2]},
            {"op": "decode", "sample": [1], "accept": [3, 2]},
        ],
        "subject-raised:AssertionError",
    ),
    "sglang-spec-commit-without-bonus": (
        15,
        48,
        3,
        [
            {"op": "submit", "uid": 0, "tokens": [2, 0, 3, 3], "max_tokens": 7},
            {"op": "prefill", "budget": 64, "sample": [1]},
            {"op": "decode", "sample": [1]},
            {"op": "decode", "sample": [1]},
            {"op": "decode", "sample": [1]},
            {"op": "decode", "sample": [1]},
            {"op": "decode", "sample": [1]},
            {"op": "decode", "sample": [1]},
        ],
        "8-request",
    ),
    "sglang-spec-commit-rejected": (
        11,
        44,
        5,
        [
            {"op": "submit", "uid": 0, "tokens": [2, 1], "max_tokens": 2},
            {"op": "prefill", "budget": 64, "sample": [1]},
            {"op": "decode", "sample": [1]},
        ],
        "7-kv-provenance",
    ),
    "sglang-spec-allocated-not-recorded": (
        12,
        48,
        7,
        [
            {"op": "submit", "uid": 0, "tokens": [2], "max_tokens": 2},
            {"op": "prefill", "budget": 64, "sample": [2]},
            {"op": "decode", "sample": [1], "accept": [3, 2]},
        ],
        "8-request",
    ),
    "sglang-spec-reserve-from-allocated": (
        15,
        48,
        3,
        [
            {"op": "submit", "uid": 0, "tokens": [2], "max_tokens": 6},
            {"op": "prefill", "budget": 64, "sample": [3]},
            {"op": "decode", "sample": [3], "accept": [1, 0]},
            {"op": "decode", "sample": [0], "accept": [1, 1]},
        ],
        "11-over-allocation",
    ),
    "sglang-spec-insert-up-to-allocated": (
        11,
        44,
        5,
        [
            {"op": "submit", "uid": 0, "tokens": [2, 1], "max_tokens": 2},
            {"op": "prefill", "budget": 64, "sample": [1]},
            {"op": "decode", "sample": [1]},
        ],
        "7-kv-provenance",
    ),
    "sglang-spec-row-freed-to-allocated": (
        12,
        48,
        7,
        [
            {"op": "submit", "uid": 0, "tokens": [2], "max_tokens": 2},
            {"op": "prefill", "budget": 64, "sample": [2]},
            {"op": "decode", "sample": [1], "accept": [3, 2]},
        ],
        "1-2-partition",
    ),
    "sglang-spec-estimate-without-reserve": (
        12,
        48,
        7,
        [
            {"op": "submit", "uid": 13, "tokens": [2, 3, 3, 2, 3, 2, 0, 1, 2, 0, 0, 0, 1], "max_tokens": 2},
            {"op": "submit", "uid": 14, "tokens": [2, 3, 3, 2, 3, 0, 2, 2, 0], "max_tokens": 2},
            {"op": "submit", "uid": 15, "tokens": [2], "max_tokens": 2},
            {"op": "prefill", "budget": 64, "sample": [1]},
            {"op": "decode", "sample": [1]},
        ],
        "subject-raised:RuntimeError",
    ),
}


def test_zoo_is_complete_and_applies_to_the_installed_version():
    names = [e.name for e in sglang_spec.ZOO]
    assert len(names) >= 5 and len(set(names)) == len(names)
    assert set(names) == set(SCRIPTS)
    for edit in sglang_spec.ZOO:
        edited_function(edit)  # EditError unless the text occurs exactly once
    assert parse_spec("sglang:spec").zoo() == sglang_spec.ZOO


@pytest.mark.parametrize("edit", sglang_spec.ZOO, ids=lambda e: e.name)
def test_judge_catches_zoo_entry(edit):
    pages, max_seq_len, rows, ops, kind = SCRIPTS[edit.name]
    config = SubjectConfig(num_pages=pages, page_size=4, max_seq_len=max_seq_len, max_running_req=rows)
    finding, _ = drive(_build(config, [edit]), config, ops)
    assert finding is not None and finding.kind == kind, f"{edit.name}: {finding}"
    clean, driver = drive(_build(config), config, ops)
    assert clean is None, f"{edit.name}: the unedited subject fails the same trace: {clean}"
    assert driver.ops == len(ops)


def test_seeded_cases_find_nothing_and_reach_speculation():
    from kvledger.checker.subject_walk import run_case

    events: set = set()
    for seed in range(12):
        result = run_case(lambda config: sglang_spec.build(config), seed, (4,))
        assert result.finding is None, f"seed {seed}: {result.finding}\n{result.finding.detail}"
        events |= set(result.events)
    assert {"spec: a draft rejected", "ahead: a request holds slots past its tokens", "prefill: chunked"} <= events
