"""Every clause of the judge (engine/ledger/invariants.py) reports exactly the violation planted for it.

Each test builds a valid state with real operations (two live requests sharing a cached prefix,
one running, one mid-chunk), checks that it passes, plants one violation by a direct edit of raw
state, and expects that clause's invariant and message: weakening or deleting a clause fails here.
"""

import pytest
import torch

from kvledger.engine.ledger import trace
from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from kvledger.engine.ledger.invariants import InvariantViolation, prefix_hashes, tolist

PS = 2
OPS = [
    {"op": "submit", "uid": 0, "tokens": [1, 2, 3, 4, 5], "max_tokens": 3},
    {"op": "prefill", "budget": 64, "sample": [6]},  # running; [1, 2, 3, 4] cached and locked
    {"op": "submit", "uid": 1, "tokens": [1, 2, 3, 4, 7, 8, 9, 9, 9], "max_tokens": 2},
    {"op": "prefill", "budget": 3, "sample": []},  # hits [1, 2, 3, 4], then mid-chunk at 7 of 9
]


def _state(impl, admission="reserve"):
    header = trace.Header(
        num_pages=16, page_size=PS, cache_type="radix", table_slots=4, max_seq_len=32, admission=admission
    )
    d = CacheScheduler(impl, **header.cache_scheduler_args())
    for op in OPS:
        d.apply(op)
    assert sorted(d.live) == [0, 1] and d.is_chunked(d.live[1]) and d.live[1].cache_handle.cached_len == 4
    d.check()  # the unplanted state is valid
    return d


def _expect(d, invariant, message):
    with pytest.raises(InvariantViolation, match=message) as caught:
        d.check()
    assert caught.value.invariant == invariant


def _set_free(d, locations):
    d.cm.free_slots = torch.tensor(locations, dtype=torch.int32) if torch.is_tensor(d.cm.free_slots) else locations


def _node(d):
    return d.cm.prefix_cache.nodes()[0]


def test_quiescence_is_judged_first(impl):
    header = trace.Header(num_pages=8, page_size=PS, cache_type="radix", table_slots=2, max_seq_len=16)
    d = CacheScheduler(impl, **header.cache_scheduler_args())
    for op in OPS[:2] + [{"op": "finish", "uid": 0}]:
        d.apply(op)
    d.check()
    _node(d).ref_count += 1  # the lock recount would also object: quiescence speaks first
    _expect(d, "5-quiescence", rf"no live request, but cache nodes \[{_node(d).id}\] are locked")


def test_a_location_that_is_not_a_page_start(impl):
    d = _state(impl)
    _set_free(d, tolist(d.cm.free_slots)[:-1] + [1])
    _expect(d, "1-2-partition", "the free list holds location 1, not a page start of the pool")


def test_a_location_outside_the_pool(impl):
    d = _state(impl)
    _set_free(d, tolist(d.cm.free_slots) + [16 * PS])
    _expect(d, "1-2-partition", f"the free list holds location {16 * PS}, not a page start")


def test_a_cache_node_whose_key_and_locations_differ(impl):
    d = _state(impl)
    node = _node(d)
    node.value = node.value[:PS]
    _expect(d, "1-2-partition", f"cache node {node.id}: key length 4, 2 locations")


def test_a_page_nobody_owns(impl):
    d = _state(impl)
    free = tolist(d.cm.free_slots)
    _set_free(d, free[1:])
    _expect(d, "1-2-partition", rf"page {free[0] // PS} \(location {free[0]}\) is owned by nobody")


def test_a_page_owned_twice(impl):
    d = _state(impl)
    free = tolist(d.cm.free_slots)
    _set_free(d, free + free[:1])
    _expect(d, "1-2-partition", rf"location {free[0]}\) is owned by \['the free list', 'the free list'\]")


def test_a_row_that_does_not_start_with_its_locked_prefix(impl):
    d = _state(impl)
    row = d.page_table[d.live[1].table_idx]
    row[0], row[2] = row[2], row[0]
    _expect(d, "1-2-partition", "uid 1: its row does not start with the 4 locations of the prefix it locked")


def test_a_row_that_is_not_page_contiguous(impl):
    d = _state(impl)
    row = d.page_table[d.live[1].table_idx]
    row[5] = row[4] + 3  # position 5 is on uid 1's own page [4, 6)
    _expect(d, "1-2-partition", "uid 1: its row is not page-contiguous at position 5")


def test_a_lock_count_no_request_accounts_for(impl):
    d = _state(impl)
    node = _node(d)
    node.ref_count += 1
    _expect(d, "1-2-partition", f"cache node {node.id} has lock count 3, but 2 live requests hold it")


def test_tokens_that_do_not_start_with_the_prompt(impl):
    d = _state(impl)
    prompt, max_tokens = d.submitted[0]
    d.submitted[0] = ((9,) + prompt[1:], max_tokens)
    _expect(d, "8-request", "uid 0: its tokens do not start with its prompt")


def test_a_max_device_len_the_submission_does_not_give(impl):
    d = _state(impl)
    prompt, max_tokens = d.submitted[0]
    d.submitted[0] = (prompt, max_tokens + 1)
    _expect(d, "8-request", "uid 0: max_device_len 8 with output_len 3, but it was submitted with 5 \\+ 4")


def test_lengths_out_of_order(impl):
    d = _state(impl)
    d.live[0].device_len += 1
    _expect(d, "8-request", r"uid 0: lengths handle 4, cached 5, device 7, with 6 tokens \(running\)")


def test_a_mid_chunk_request_with_wrong_lengths(impl):
    d = _state(impl)
    d.live[1].device_len -= 1
    _expect(d, "8-request", r"uid 1: lengths handle 4, cached 7, device 7, with 7 tokens \(mid-chunk\)")


def test_a_running_request_that_generated_all_its_tokens(impl):
    d = _state(impl)
    req = d.live[0]  # 5 prompt tokens + 1 generated of 3: two decode steps the scheduler never released
    for token in (6, 6):
        d.cm.allocate_paged([req])
        d.provenance.written(
            tolist(d.page_table[req.table_idx][req.cached_len : req.device_len]), tolist(req.input_ids), req.cached_len
        )
        req.complete_one()
        req.append_host(token)
    _expect(d, "8-request", "uid 0: running with 3 tokens generated of 3")


def test_a_token_pool_row_that_lost_its_tokens(impl):
    d = _state(impl)
    d.tm.token_pool[d.live[1].table_idx][6] = 5
    _expect(d, "8-request", "uid 1: its token-pool row does not hold its 7 admitted tokens")


def test_reserve_that_no_longer_covers_the_worst_case(impl):
    d = _state(impl)
    req = d.live[0]  # consistently larger than admission allowed for: 8-request still holds
    prompt, max_tokens = d.submitted[0]
    extra = 64
    d.submitted[0] = (prompt, max_tokens + extra)
    req.max_device_len += extra
    req.output_len += extra
    if hasattr(req, "_buf"):  # fast sizes its token buffer by max_device_len
        req._buf = __import__("numpy").resize(req._buf, req.max_device_len)
    _expect(d, "3-no-oom", r"live requests may still need \d+ tokens of pages, only \d+ available")


def test_optimistic_needs_each_request_alone_to_fit_the_pool(impl):
    d = _state(impl, admission="optimistic")
    d.waiting[0].sampling_params.max_tokens = 64  # uid 1's queue entry (mid-chunk)
    _expect(d, "3-no-oom", "uid 1 may need more than the pool's 32 tokens")


def test_a_row_pointing_at_kv_of_other_tokens(impl):
    d = _state(impl)
    loc = int(d.page_table[d.live[0].table_idx][4])  # uid 0's own page
    d.provenance.at[loc] = prefix_hashes([1, 2, 3, 4, 9])[-1]
    _expect(d, "7-kv-provenance", f"uid 0: position 4 points at location {loc}, which holds KV computed for other")
