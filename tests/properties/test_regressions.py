"""The regression corpus: every trace in tests/regressions replays on reference and fast with no
divergence and no invalid operation. Add one with
`kvledger minimize FAILING.jsonl -o tests/regressions/NAME.jsonl` once the bug is fixed."""

import pytest

from kvledger.engine.ledger.trace import read
from kvledger.properties.lockstep import Finding, replay
from kvledger.subjects.fast_zoo import BUGS, patched
from tests.support.paths import REGRESSIONS

CORPUS = sorted(REGRESSIONS.glob("*.jsonl"))

# traces that exist to catch a known bug: with it patched back in, they must diverge
CATCHES = {
    "same_prefix_prefill_together": "no-remap-on-duplicate",
    "tiny_requests_page_size_4_in_3_pages": "reservation-in-tokens",
    # found by `kvledger fuzz --bug ...`, kept as `kvledger minimize` wrote them
    "lru_touched_on_prefix_hit": "lru-not-touched-on-match",
    "admission_rechecks_after_locking": "no-recheck-after-lock",
}


def test_the_corpus_is_there():
    assert len(CORPUS) >= 4
    assert {p.stem for p in CORPUS} >= set(CATCHES)


@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_trace_replays_clean(path):
    header, ops = read(path)
    assert ops, f"{path} has no operations"
    lock = replay(header, ops)  # raises Finding or InvalidOp on any problem
    assert lock.step == len(ops)


@pytest.mark.parametrize("name,bug", sorted(CATCHES.items()))
def test_trace_catches_its_bug(name, bug):
    if bug not in BUGS:
        pytest.skip(f"bug {bug!r} is not in the zoo")
    header, ops = read(REGRESSIONS / f"{name}.jsonl")
    with patched(bug), pytest.raises(Finding):
        replay(header, ops)
