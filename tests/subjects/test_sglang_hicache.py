"""sglang:hicache: SGLang 0.5.23's hierarchical cache on a CPU, driven by kvledger's driver: prefixes
backed up to host as they are cached, evicted from device and kept on host, loaded back on a hit with
the KV they had; the zoo's planted bugs caught on their traces.

Needs the installed sglang (the `# sglang` section of subjects-constraints.txt); skips without it.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Dict, List

import pytest

from kvledger.engine.ledger.invariants import prefix_hashes
from kvledger.engine.ledger.trace import read
from kvledger.properties.subject import SubjectConfig
from kvledger.properties.subject_driver import SubjectDriver, drive
from kvledger.properties.target import config_of
from kvledger.subjects import parse_spec, sglang, sglang_hicache
from kvledger.subjects.edits import edited_function
from kvledger.subjects.sglang_hicache_zoo import HOST_MHA, HOST_POOL_COMMON

P = list(range(100, 120))  # five pages at page size 4

pytestmark = pytest.mark.usefixtures("sglang_importable")


def _submit(uid: int, tokens: List[int], max_tokens: int) -> Dict[str, Any]:
    return {"op": "submit", "uid": uid, "tokens": tokens, "max_tokens": max_tokens}


PREFILL: Dict[str, Any] = {"op": "prefill", "budget": 64}
DECODE: Dict[str, Any] = {"op": "decode"}


def _built(num_pages: int = 8) -> tuple[Any, SubjectDriver, List[str]]:
    config = SubjectConfig(num_pages=num_pages, page_size=4, max_seq_len=48, max_running_req=4)
    s = sglang_hicache.build(config)
    events: List[str] = []
    return s, SubjectDriver(s, config, on_event=events.append), events


def test_the_spec_builds_the_default_tree_with_a_host_tier_and_leaves_the_process_as_it_was():
    spec = parse_spec("sglang:hicache")
    assert spec.page_sizes() == (2, 4) and spec.zoo() == sglang_hicache.ZOO
    s, _, _ = _built()
    assert s.name == "sglang:hicache" and type(s.tree).__name__ == "UnifiedRadixCache"
    host = s.controller.mem_pool_host.anchor_entry.host_pool
    assert type(host).__name__ == "MHATokenToKVPoolHost" and host.layout == "layer_first"
    assert s.controller.io_backend == "direct" and s.controller.write_policy == "write_through"
    assert host.available_size() >= 2 * 8 * 4  # hicache_ratio 2 of the device pool
    assert s.rare_events == sglang_hicache.HICACHE_EVENTS and not s.capabilities.external_kv
    # the stand-ins are in place only while the subject's calls run; the published config is not its own
    assert "transfer_kv_direct" not in vars(importlib.import_module(HOST_MHA))
    assert "cpu" not in importlib.import_module(HOST_POOL_COMMON).ALLOC_MEMORY_FUNCS
    from sglang.srt.runtime_context import get_memory

    assert not get_memory().enable_hierarchical_cache
    assert sglang.build(SubjectConfig(num_pages=6, page_size=4, max_seq_len=32)).tree.cache_controller is None
    with pytest.raises(ValueError, match="page size >= 2"):
        sglang_hicache.build(SubjectConfig(num_pages=6, page_size=1, max_seq_len=32))


def test_a_subject_nobody_holds_is_freed():
    """init_hicache registers the tree's storage detach at exit; unregistered (there is no storage
    backend), a fuzz's thousands of subjects do not stay alive until the process ends."""
    import gc
    import weakref

    trees = [weakref.ref(_built()[0].tree) for _ in range(3)]
    gc.collect()
    assert [t() for t in trees] == [None, None, None]


def test_a_prefix_evicted_to_host_is_loaded_back_with_the_kv_it_had():
    """uid 1's 20-token prompt is backed up to host as it is cached (write-through), evicted from
    device (kept on host), and uid 2's admission loads it back: a 20-token hit on freshly allocated
    pages that hold, layer by layer, the KV uid 1's forward pass wrote (its prefix hashes)."""
    s, driver, events = _built()
    for op in (_submit(1, P, 2), PREFILL, DECODE):
        driver.apply(op)
    assert not driver.live and s.view().counters["evictable_tokens"] == 20
    assert driver.apply({"op": "evict", "tokens": 20}).evicted_tokens == 20
    view = s.view()
    assert sglang_hicache.KEPT_ON_HOST in events and view.cached == [] and len(view.free) == 8
    driver.apply(_submit(2, P + [7, 8], 2))
    driver.apply(PREFILL)
    assert driver.hits[2] == 20 and sglang_hicache.LOADED in events
    assert sglang_hicache.BOTH_TIERS not in events  # nothing of it was on device
    row = s.view().requests[2]
    hashes = prefix_hashes(P)
    for pos in range(20):
        for layer in range(sglang_hicache.LAYERS):
            assert int(s.kv.k_buffer[layer][row[pos]].flatten()[0]) == hashes[pos]
            assert int(s.kv.v_buffer[layer][row[pos]].flatten()[0]) == pos + 1
    # the load's ack was reaped: the prefix is locked by uid 2 alone, nothing is in flight
    assert not s.tree.ongoing_load_back and not s.tree.ongoing_write_through
    assert s.view().counters["protected_tokens"] == 20


def test_a_hit_on_device_continues_on_host():
    """uid 2 shares uid 1's first two pages and splits its node; evicting uid 2's own tail leaves the
    shared pages on device and the tail on host, so uid 3's hit is read from both tiers."""
    s, driver, events = _built(num_pages=12)
    for op in (_submit(1, P, 1), PREFILL, _submit(2, P[:8] + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], 1), PREFILL):
        driver.apply(op)
    assert driver.hits[2] == 8
    driver.apply({"op": "evict", "tokens": 12})
    driver.apply(_submit(3, P + [9], 1))
    driver.apply(PREFILL)
    assert driver.hits[3] == 20 and {sglang_hicache.LOADED, sglang_hicache.BOTH_TIERS} <= set(events)


def test_a_host_hit_below_the_load_back_threshold_is_recomputed():
    """init_load_back declines a load of fewer than load_back_threshold (10) tokens: the request is
    admitted on its device hit alone and computes the rest, and the host copy stays."""
    s, driver, events = _built()
    for op in (_submit(1, P[:8], 1), PREFILL, {"op": "evict", "tokens": 8}, _submit(2, P[:8] + [5], 1), PREFILL):
        driver.apply(op)
    assert s.tree.load_back_threshold == 10
    assert driver.hits[2] == 0 and sglang_hicache.LOADED not in events


def test_backups_past_the_host_pool_evict_host_only_prefixes():
    """Eight distinct 16-token prompts through an 8-page device pool whose host pool holds twice
    that: each is backed up as it is cached and pushed to host by the next; once the host pool is
    full, a backup evicts the least recent host-only prefix from host (and the tree), and the device
    pool's ledger stays whole throughout (the judge runs after every operation)."""
    s, driver, events = _built()
    host = s.controller.mem_pool_host.anchor_entry.host_pool
    capacity = host.available_size()
    for uid in range(8):
        driver.apply(_submit(uid, [1000 * (uid + 1) + t for t in range(16)], 1))
        driver.apply(PREFILL)
    assert {sglang_hicache.KEPT_ON_HOST, sglang_hicache.HOST_EVICTED} <= set(events)
    assert 8 * 16 > capacity >= host.available_size() >= 0
    first = [1000 + t for t in range(16)]  # the least recent: gone from both tiers
    driver.apply(_submit(9, first + [1], 1))
    driver.apply(PREFILL)
    assert driver.hits[9] == 0


# each zoo entry's failing trace, as `kvledger zoo --subject sglang:hicache` found and minimized it
TRACES = Path(__file__).parent / "sglang_hicache_traces"
KINDS = {
    "sglang-hicache-load-back-child-first": "7-kv-provenance",
    "sglang-hicache-load-back-offset-stuck": "1-2-partition",
    "sglang-hicache-host-hit-counts-device-nodes": "subject-raised:RuntimeError",  # add_one_req's own check
    "sglang-hicache-load-ack-keeps-lock": "1-2-partition",
    "sglang-hicache-write-ack-keeps-lock": "1-2-partition",
    "sglang-hicache-direct-indices-unpaired": "7-kv-provenance",
}


def test_the_zoo_applies_to_the_installed_version():
    names = [e.name for e in sglang_hicache.ZOO]
    assert len(names) >= 5 and len(set(names)) == len(names) and set(names) == set(KINDS)
    assert {p.stem for p in TRACES.glob("sglang-hicache-*.jsonl")} == set(KINDS)
    for edit in sglang_hicache.ZOO:
        edited_function(edit)


@pytest.mark.parametrize("edit", sglang_hicache.ZOO, ids=lambda e: e.name)
def test_zoo_entry_is_caught_on_its_trace_and_the_clean_subject_passes(edit):
    header, ops = read(TRACES / f"{edit.name}.jsonl")
    assert header.subject == "sglang:hicache"
    config = config_of(header)
    finding, _ = drive(sglang_hicache.build(config, edits=[edit]), config, ops)
    assert finding is not None and finding.kind == KINDS[edit.name], f"{edit.name}: {finding}"
    clean, driver = drive(sglang_hicache.build(config), config, ops)
    assert clean is None, f"{edit.name}: the unedited subject fails the same trace: {clean}"
    assert driver.ops == len(ops)
