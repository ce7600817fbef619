"""Overlap scheduling (the next step launched before the previous step's tokens reach the host)
on the CPU with a tiny random model: the same tokens, the same cache-operation sequence, and
shadow verification passing, as the serial scheduler."""

import random

import pytest
import torch

from kvledger.engine.ledger.ops import Decode, Finish
from kvledger.engine.ledger.trace import read
from kvledger.engine.runtime.llm import LLM
from kvledger.fast import SamplingParams
from kvledger.properties.lockstep import replay
from tests.support.models import tiny_config

TINY = tiny_config(max_position_embeddings=1024, eos_token_ids=(7,))


def _llm(overlap, **kw):
    torch.set_num_threads(1)
    opts = dict(
        dummy_weights=True,
        page_size=4,
        kv_cache_tokens=512,
        max_running_req=6,
        max_seq_len=128,
        max_prefill_tokens=48,
        seed=3,
    )
    opts.update(kw)
    return LLM(TINY, overlap=overlap, **opts)


def _workload(n=14, seed=0):
    rng = random.Random(seed)
    shared = [rng.randrange(512) for _ in range(20)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(512) for _ in range(rng.randint(1, 30))]
        prompts.append(shared + tail if i % 3 == 0 else tail)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(1, 24)) for _ in range(n)]
    return prompts, params


def _run(llm, prompts, params):
    return [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_overlap_defers_bookkeeping_and_gives_the_same_tokens():
    prompts, params = _workload()
    serial = _run(_llm(False), prompts, params)
    llm = _llm(True)
    deferred = []  # per step: were its tokens still "on the device" when step() returned?
    for p, sp in zip(prompts, params):
        llm._submit(p, sp)
    while llm.engine.has_work:
        llm.engine.step()
        deferred.append(llm.engine.overlap.inflight is not None)
    assert sum(deferred) > 10, "overlap never left a step in flight"
    assert _run(_llm(True), prompts, params) == serial
    assert all(reason == "length" for _, reason in serial)


def test_small_pool_with_waiting_and_eviction_matches_serial():
    prompts, params = _workload(n=20, seed=1)
    big = _run(_llm(False, kv_cache_tokens=2048), prompts, params)
    small = _llm(True, kv_cache_tokens=160)
    assert _run(small, prompts, params) == big
    d = small.engine.cache_scheduler
    assert not d.live and small.engine.overlap.inflight is None
    d.cm.check_integrity()
    cached = d.cm.prefix_cache.size_info
    assert d.cm.available_size == d.cm.num_pages * d.cm.page_size  # every page free or evictable
    assert cached.protected_size == 0


def test_trace_with_overlap_is_the_serial_trace_and_replays(tmp_path):
    prompts, params = _workload(seed=2)
    traces = {}
    for overlap in (False, True):
        path = tmp_path / f"overlap-{overlap}.jsonl"
        llm = _llm(overlap, trace=str(path))
        _run(llm, prompts, params)
        llm.close()
        traces[overlap] = path
    header_s, ops_s = read(str(traces[False]))
    header_o, ops_o = read(str(traces[True]))
    assert ops_o == ops_s
    assert any(isinstance(record.op, Decode) for record in ops_o)
    replay(header_o, ops_o)  # reference and fast in lockstep: raises on any divergence


def test_verify_with_overlap_on_stops_and_sampling():
    prompts, params = _workload(seed=4)
    rng = random.Random(4)
    mixed = []
    for i, p in enumerate(params):  # EOS may stop some, some sample, some ignore EOS
        if i % 3 == 0:
            mixed.append(SamplingParams(temperature=0.0, max_tokens=p.max_tokens))
        elif i % 3 == 1:
            mixed.append(SamplingParams(temperature=0.8, top_k=20, max_tokens=p.max_tokens, seed=rng.randrange(99)))
        else:
            mixed.append(p)
    llm = _llm(True, verify=True)
    got = _run(llm, prompts, mixed)
    assert llm.shadow.steps > 20
    assert got == _run(_llm(False), prompts, mixed)


def test_abort_of_a_request_whose_last_step_is_in_flight():
    llm = _llm(True)
    s = llm.engine
    s.add_request([1, 2, 3], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2), 100)
    s.add_request([4, 5, 6], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6), 101)
    events = []
    while s.requests[100].finishing is None:
        events += s.step()
        assert s.has_work
    s.abort(100)  # released by its last step already: no cache operation, and no more tokens
    while s.has_work:
        events += s.step()
    assert sum(e.uid == 100 for e in events) == 1  # its first token only
    assert [e.finished for e in events if e.uid == 101][-1]
    assert sum(e.uid == 101 for e in events) == 6
    s.check_idle()


@pytest.mark.parametrize("overlap", [False, True])
def test_graphs_and_fused_path_are_cuda_only(overlap):
    llm = _llm(overlap)
    assert llm.engine.graphs is None
    assert not llm.model.uses_fused_path()


def _stop_workload(seed):
    """Greedy requests that stop on tokens the tiny model really produces (late stops)."""
    prompts, params = _workload(n=16, seed=seed)
    plain = _run(_llm(False), prompts, params)
    counts = {}
    for tokens, _ in plain:
        for t in tokens[1:]:
            counts[t] = counts.get(t, 0) + 1
    common = sorted(counts, key=lambda t: (-counts[t], t))[:3]
    params = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens, stop_token_ids=common) for p in params]
    return prompts, params


def test_late_stops_give_the_serial_tokens_and_replay(tmp_path):
    prompts, params = _stop_workload(seed=5)
    serial = _run(_llm(False), prompts, params)
    assert sum(reason == "stop" for _, reason in serial) >= 3
    path = tmp_path / "late.jsonl"
    llm = _llm(True, trace=str(path))
    assert _run(llm, prompts, params) == serial  # tokens up to and including the stop token
    llm.close()
    assert llm.engine.late_stops >= 3
    header, ops = read(str(path))
    replay(header, ops)  # the overlapped schedule, wasted tokens included, is a valid one
    d = llm.engine.cache_scheduler
    assert not d.live
    d.cm.check_integrity()


def test_shadow_verification_checks_the_overlapped_schedule(tmp_path):
    """With --verify the scheduler still overlaps (late stops included): the shadow compares the
    state frozen right after each operation, so its operation sequence is the unverified one's."""
    prompts, params = _stop_workload(seed=6)
    traces = []
    for verify in (False, True):
        path = tmp_path / f"verify-{verify}.jsonl"
        llm = _llm(True, trace=str(path), verify=verify)
        _run(llm, prompts, params)
        llm.close()
        traces.append(read(str(path))[1])
        if verify:
            assert llm.engine.late_stops >= 3 and llm.shadow.steps == len(traces[-1])
    assert traces[0] == traces[1]


def test_a_late_stop_next_to_a_prefill_is_a_finish_operation(tmp_path):
    """When the step after a late stop is a prefill (the stopped request is not in it), the
    request is released by a `finish` operation right after that prefill's bookkeeping."""
    prompts, params = _stop_workload(seed=7)
    path = tmp_path / "finish.jsonl"
    llm = _llm(True, trace=str(path), verify=True, max_running_req=3)
    got = _run(llm, prompts, params)
    llm.close()
    header, ops = read(str(path))
    assert any(isinstance(record.op, Finish) for record in ops)
    assert got == _run(_llm(False, max_running_req=3), prompts, params)
    replay(header, ops)


def test_the_engine_remembers_no_uid_but_the_last():
    """A long-running engine keeps O(1) state per past request id: uids must increase."""
    llm = _llm(True)
    prompts, params = _workload(n=5)
    _run(llm, prompts, params)
    d = llm.engine.cache_scheduler
    assert d.known == set() and d.last_uid == 4
    with pytest.raises(ValueError, match="uids must increase"):
        llm.engine.add_request([1, 2], SamplingParams(max_tokens=1), 3)
    assert [o.uid for o in llm.generate([[1, 2]], SamplingParams(max_tokens=1), use_tqdm=False)] == [5]
