"""A worked adapter: a cache manager with mini-sglang's `CacheManager` API put under kvledger's
judge. It drives kvledger's own `reference` manager (which has that API) here; point the imports
at your manager. Run it:
`PYTHONPATH=docs/examples kvledger fuzz --subject my_cache_manager_subject:build --seconds 30`."""

from __future__ import annotations

from typing import Dict, List, Sequence

from kvledger.checker import CachedEntry, Capabilities, SubjectConfig, View
from kvledger.reference import CacheManager, PendingReq, Req, SamplingParams, make_page_table


class MyCacheManagerSubject:
    name, version = "my-cache-manager-example", "1"

    def __init__(self, config: SubjectConfig) -> None:
        ps = self.ps = config.page_size
        self.capabilities = Capabilities(
            page_size=ps,
            pages=tuple(range(config.num_pages)),
            chunked_prefill=False,
            worst_case_admission=True,
            preempts=False,
            explicit_evict=True,
            cached_pages_in_free_pool=False,
        )
        self.table = make_page_table(config.max_running_req, -(-config.max_seq_len // ps) * ps)
        self.cm = CacheManager(config.num_pages, ps, self.table, "radix")
        self.rows = list(range(config.max_running_req))
        self.pending: Dict[int, PendingReq] = {}
        self.live: Dict[int, Req] = {}
        self.allocated: set = set()  # uids with pages for [cached_len, device_len), not yet computed

    def _pages_to_finish(self, held: int, last: int) -> int:  # KV for every position but the last token's
        return max(-(-(last - 1) // self.ps) - -(-held // self.ps), 0)

    def submit(self, uid: int, prompt: Sequence[int], max_tokens: int) -> None:
        self.pending[uid] = PendingReq(uid, list(prompt), SamplingParams(max_tokens=max_tokens))

    def admit(self, uid: int, budget: int) -> int | None:
        pending = self.pending[uid]
        handle = self.cm.match_req(pending).cuda_handle
        promised = sum(self._pages_to_finish(r.cached_len, r.max_device_len) for r in self.live.values())
        need = promised + self._pages_to_finish(handle.cached_len, pending.input_len + pending.output_len)
        self.cm.lock(handle)  # locked first: what is evictable shrinks by the hit
        if not self.rows or need * self.ps > self.cm.available_size:
            self.cm.unlock(handle)
            return None
        row = self.rows.pop()
        self.table[row][: handle.cached_len] = list(handle.get_matched_indices())
        self.live[uid] = Req(
            pending.input_ids, row, handle.cached_len, pending.output_len, uid, pending.sampling_params, handle
        )
        del self.pending[uid]
        return handle.cached_len

    def allocate(self, uid: int, start: int, end: int) -> bool:
        self.cm.allocate_paged([self.live[uid]])  # pages for [cached_len, device_len) == [start, end)
        self.allocated.add(uid)
        return True

    def computed(self, uid: int, start: int, end: int, token: int | None) -> None:
        req = self.live[uid]
        req.complete_one()
        self.allocated.discard(uid)
        req.append_host(token)  # no chunked prefill: every step ends with a sampled token
        if start == req.cache_handle.cached_len and req.can_decode:  # its prefill: hand the prompt's KV over
            with self.cm.lazy_free_region():
                self.cm.cache_req(req, finished=False)

    def finish(self, uid: int) -> None:
        req = self.live.pop(uid)
        with self.cm.lazy_free_region():
            self.rows.append(req.table_idx)
            self.cm.cache_req(req, finished=True)

    def abort(self, uid: int) -> None:
        self.finish(uid) if uid in self.live else self.pending.pop(uid)

    def preempt(self, uid: int) -> None:
        raise NotImplementedError("worst-case admission: nothing is preempted")

    def evict(self, tokens: int) -> int:
        evicted = self.cm.prefix_cache.evict(tokens)
        self.cm.free_slots += evicted[:: self.ps]  # the caller frees what the prefix cache evicts, by page
        return len(evicted)

    def view(self) -> View:
        rows = {
            uid: self.table[r.table_idx][: r.device_len if uid in self.allocated else r.cached_len]
            for uid, r in self.live.items()
        }
        paths: Dict[int, List[int]] = {}
        cached = []
        for node in self.cm.prefix_cache.nodes():  # parents before children
            above = paths.get(node.parent.id, []) if node.parent is not None else []
            paths[node.id] = above + list(node.key)
            cached.append(
                CachedEntry(
                    tuple(node.value), len(above), tuple(paths[node.id]), lock=node.ref_count, name=f"node {node.id}"
                )
            )
        info = self.cm.prefix_cache.size_info
        return View(
            free=[loc // self.ps for loc in self.cm.free_slots],
            requests=rows,
            cached=cached,
            counters={
                "free_pages": len(self.cm.free_slots),
                "evictable_tokens": info.evictable_size,
                "protected_tokens": info.protected_size,
            },
        )

    def cache_key(self, tokens: Sequence[int]) -> None:
        raise NotImplementedError("a radix tree files prefixes by their path")


def build(config: SubjectConfig) -> MyCacheManagerSubject:
    return MyCacheManagerSubject(config)
