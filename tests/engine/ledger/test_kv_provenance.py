"""Invariant 7, KV provenance: every location a live request or the prefix cache points at, below
what is computed, holds KV computed for exactly that token prefix. It sees what no comparison of
reference and fast can: a bug both share that reuses KV computed for other tokens."""

import pytest
import torch

from kvledger import fast, reference
from kvledger.checker.audit.invariant_catches import TRUSTS_WHOLE_EDGE, shared
from kvledger.engine.ledger import trace
from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.invariants import InvariantViolation, KVProvenance, prefix_hashes
from kvledger.properties.lockstep import Lockstep
from tests.support.models import tiny_config

HEADER = trace.Header(num_pages=32, page_size=1, cache_type="radix", table_slots=4, max_seq_len=32)
WRONG_REUSE = [
    {"op": "submit", "uid": 0, "tokens": [1, 2, 3, 4, 5], "max_tokens": 1},
    {"op": "prefill", "budget": 64, "sample": [0]},  # finishes: [1, 2, 3, 4, 5] is cached
    {"op": "submit", "uid": 1, "tokens": [1, 9, 9, 9, 9, 7], "max_tokens": 2},
    {"op": "prefill", "budget": 64, "sample": [0]},  # shares only [1], but the bug reuses 5
]


def _apply(lock, ops):
    for op in ops:
        lock.apply(op)


def test_a_shared_wrong_reuse_is_caught_at_the_reuse_itself():
    _apply(Lockstep(HEADER), WRONG_REUSE)  # correct code: the second request reuses one token
    with shared(TRUSTS_WHOLE_EDGE):
        with pytest.raises(Finding) as caught:
            _apply(Lockstep(HEADER), WRONG_REUSE)
    assert caught.value.kind == "reference-invariant:7-kv-provenance" and caught.value.step == 4
    assert "uid 1: position 1 points at location 1, which holds KV computed for other tokens" in caught.value.message


def test_without_provenance_both_sides_agree_on_the_wrong_reuse():
    """The reason invariant 7 exists: reference and fast make the same wrong reuse and agree."""
    with shared(TRUSTS_WHOLE_EDGE):
        lock = Lockstep(HEADER)
        lock.ref.provenance = lock.fast.provenance = None
        _apply(lock, WRONG_REUSE)
        # uid 1 reads uid 0's KV for positions 1-4 ([2, 3, 4, 5], not its [9, 9, 9, 9])
        assert lock.ref.snapshot()["rows"][1][:5] == lock.fast.snapshot()["rows"][1][:5] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("impl", [reference, fast], ids=["reference", "fast"])
def test_the_prefix_cache_is_judged_too(impl):
    from kvledger.engine.ledger.cache_scheduler import CacheScheduler

    d = CacheScheduler(impl, **HEADER.cache_scheduler_args())
    for op in WRONG_REUSE[:2]:
        d.apply(op)
    d.check()
    node = d.cm.prefix_cache.nodes()[0]
    first = int(node.value[0])
    d.provenance.at[first] = prefix_hashes([7])[0]  # plant: the cached KV of [1] was computed for [7]
    with pytest.raises(
        InvariantViolation,
        match=rf"cache node {node.id}: position 0 points at location {first}, "
        "which holds KV computed for other tokens",
    ):
        d.check()
    del d.provenance.at[first]
    with pytest.raises(InvariantViolation, match="which was never computed"):
        d.check()


def test_provenance_records_what_a_forward_pass_wrote():
    p = KVProvenance()
    p.written([10, 11], [5, 6, 7], start=1)  # positions 1 and 2 of [5, 6, 7]
    h = prefix_hashes([5, 6, 7])
    p.check("x", [10, 11], h[1:], start=1)
    with pytest.raises(InvariantViolation, match="x: position 1 points at location 11"):
        p.check("x", [11], h[1:2], start=1)
    assert prefix_hashes([5, 6]) == h[:2] and prefix_hashes([5, 7])[1] != h[1]


def test_a_shared_wrong_reuse_stops_the_engine_under_verify():
    """`--verify` mirrors the engine's operations into the reference model, whose judge tracks
    provenance (the engine's own driver cannot: its sampled tokens are still on the device)."""
    from kvledger.engine.runtime.llm import LLM
    from kvledger.fast import SamplingParams

    torch.set_num_threads(1)
    tiny = tiny_config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        max_position_embeddings=256,
        eos_token_ids=(63,),
    )
    llm = LLM(
        tiny,
        dummy_weights=True,
        page_size=1,
        kv_cache_tokens=64,
        max_running_req=2,
        max_seq_len=32,
        max_prefill_tokens=64,
        seed=0,
        verify=True,
        overlap=False,
    )
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
    llm.generate([[1, 2, 3, 4, 5]], [greedy], use_tqdm=False)
    with shared(TRUSTS_WHOLE_EDGE):
        with pytest.raises(Exception, match="7-kv-provenance"):
            llm.generate([[1, 9, 9, 9, 9, 7]], [greedy], use_tqdm=False)
