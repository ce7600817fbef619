"""Refused operations: what the cache scheduler must turn away in a state (`invalid_ops`, which
the fuzzer draws from too) and the lockstep rule that checks a refusal changes nothing."""

from __future__ import annotations

from typing import Any, Dict, List

from hypothesis import strategies as st
from hypothesis.stateful import rule

from kvledger.engine.ledger import trace
from kvledger.engine.ledger.ops import InvalidOp
from kvledger.properties.lockstep_core import LockstepCore


def invalid_ops(ref: Any, header: trace.Header, next_uid: int) -> List[Dict[str, Any]]:
    """Operations the cache scheduler `ref` (the reference side) must refuse in its state, leaving
    it as it was; `next_uid` is the next unused uid. The machine's `invalid` rule and the fuzzer
    draw from these."""
    pool = header.num_pages * header.page_size
    ops = [
        {"op": "submit", "uid": next_uid, "tokens": [0] * header.max_seq_len, "max_tokens": 1},
        {"op": "submit", "uid": next_uid, "tokens": [], "max_tokens": 1},
        {"op": "submit", "uid": next_uid, "tokens": [0], "max_tokens": 0},
        {"op": "prefill", "budget": 0, "sample": []},
        {"op": "finish", "uid": next_uid},
        {"op": "abort", "uid": next_uid},
        {"op": "evict", "tokens": ref.cm.prefix_cache.size_info.evictable_size + 1},
        {"op": "evict", "tokens": -1},
        {"op": "probe"},
        {"op": "no-such-op"},
    ]
    if next_uid:
        ops.append({"op": "submit", "uid": next_uid - 1, "tokens": [0], "max_tokens": 1})
    if header.policy.preempts:  # its worst case is bigger than the pool: preemption could never fit it
        ops.append({"op": "submit", "uid": next_uid, "tokens": [0] * (pool + 1), "max_tokens": 1})
    if ref.waiting:
        ops.append({"op": "finish", "uid": ref.waiting[0].uid})
    # a stop may name only a request of the step that samples: on an empty step, none
    ops.append({"op": "decode", "sample": [], "stop": [next_uid]})
    ops.append({"op": "prefill", "budget": 1024, "sample": [], "stop": [next_uid]})
    running = ref.dm.running_reqs.uids()
    if running:
        ops.append({"op": "decode", "sample": [], "stop": running[:1] * 2})
        ops.append({"op": "prefill", "budget": 1024, "sample": [], "stop": running[:1]})
    # waiting requests that will not sample, known only once admission ran (and rolled back):
    # behind the head, a budget of 1 admits nobody; a head mid-chunk with 2 tokens to go stays so
    waiting = ref.waiting
    if len(waiting) > 1:
        ops.append({"op": "prefill", "budget": 1, "sample": [], "stop": [waiting[-1].uid]})
    if waiting and waiting[0].chunked_req is not None and waiting[0].input_len - waiting[0].chunked_req.cached_len > 1:
        ops.append({"op": "prefill", "budget": 1, "sample": [], "stop": [waiting[0].uid]})
    return ops


class RefusalRules(LockstepCore):
    def _invalid_ops(self) -> List[Dict[str, Any]]:
        """Operations the scheduler must refuse in this state, leaving it as it was."""
        return invalid_ops(self.ref, self.header, self.next_uid)

    @rule(data=st.data())
    def invalid(self, data: st.DataObject) -> None:
        """An operation the scheduler must refuse (InvalidOp), on both sides, changing nothing
        (the trace keeps only valid operations, so a refusal that changed state would not replay).
        Among them a prefill whose `stop` names a waiting request that admission leaves out or
        mid-chunk: the scheduler finds out after admitting, and rolls admission back."""
        op = data.draw(st.sampled_from(self._invalid_ops()), label="op")
        for name, side in (("reference", self.lock.ref), ("fast", self.lock.fast)):
            before = side.snapshot()
            try:
                side.apply(dict(op))
            except InvalidOp:
                self._check(side.snapshot() == before, f"the refused operation {op} changed the {name}'s state")
                continue
            self._check(False, f"{name} accepted the invalid operation {op}")
