"""The bug zoo: realistic cache-manager bugs, each a small runtime patch of one `fast` method.

The product code carries no bug switches: `patched(name)` swaps one method of a `fast` class
(or one function of a `fast` module, looked up through the module's globals at call time)
for a buggy version for the duration of a `with` block (in this process only). `reference` is
never patched, so the lockstep harness sees fast diverge from the model. One bug,
`requeue-victims-reversed`, patches the cache scheduler both sides share (where the victims'
queue order is decided): the two states agree, and only an invariant (10-queue-order) sees it.

A bug is data: the target method plus text edits of its source. The buggy method is built from
the *current* source of the live method (each edit's old text must occur in it exactly once, else
`ZooEditError`), compiled in the defining module's globals, so a bug never tests stale code.
Each edit's new text carries a `# BUG:` comment. `origin` names the project whose history had a
bug of that kind (or "ours"). `kvledger zoo` (checker/audit/zoo_run.py) measures which property run
catches each one.
"""

from __future__ import annotations
import __future__

import inspect
import linecache
import textwrap
from contextlib import contextmanager
from dataclasses import dataclass
from types import FunctionType, ModuleType
from typing import Dict, Iterator, List, Tuple

from kvledger import fast
from kvledger.engine.ledger.cache_scheduler import CacheScheduler
from kvledger.fast.radix_cache import RadixPrefixCache

Edit = Tuple[str, str]  # (text of the live method's source, the text the bug puts in its place)


class ZooEditError(RuntimeError):
    """A bug's edit no longer fits the live source: the method changed under the zoo."""


@dataclass(frozen=True)
class Bug:
    name: str
    origin: str  # where such a bug was seen (project / issue), or "ours"
    description: str
    target: type | ModuleType  # the class patched (the method may be defined on a base class), or a module
    method: str
    edits: Tuple[Edit, ...]

    def live_function(self) -> FunctionType:
        """The function the live class (or module) defines for `method` (a property's getter, a static
        method's function)."""
        owners = getattr(self.target, "__mro__", (self.target,))  # a module: its own functions
        owner = next((c for c in owners if self.method in c.__dict__), None)
        if owner is None:
            raise ZooEditError(f"zoo bug {self.name!r}: {self.target.__name__} has no {self.method!r}")
        fn = _function(owner.__dict__[self.method])
        # inside patched() the class holds a zoo function: derive from the one it replaced
        return getattr(fn, "__zoo_live__", fn)

    def source(self) -> str:
        """The live method's dedented source with this bug's edits applied."""
        live = self.live_function()
        src = textwrap.dedent(inspect.getsource(live))
        where = f"zoo bug {self.name!r} on {live.__qualname__}"
        for old, new in self.edits:
            count = src.count(old)
            if count != 1:
                raise ZooEditError(
                    f"{where}: the live source contains {old!r} {count} times, not once "
                    f"(the method changed; update the bug's edit)"
                )
            start = src.index(old)
            rest_of_line = src[start + len(old) :].split("\n", 1)[0]
            if "#" in new.rsplit("\n", 1)[-1] and rest_of_line.strip():
                raise ZooEditError(f"{where}: the comment in {new!r} would swallow {rest_of_line!r}")
            src = src.replace(old, new)
        return src

    def patches(self) -> List[Tuple[type | ModuleType, str, object]]:
        """(class, attribute, buggy value): the edited source compiled in the live module."""
        live = self.live_function()
        src = self.source()
        filename = f"<zoo {self.name}: {live.__qualname__}>"
        # the live module's `from __future__ import annotations`, if it has it
        flags = live.__code__.co_flags & __future__.annotations.compiler_flag
        namespace: Dict[str, object] = {}
        exec(compile(src, filename, "exec", flags=flags, dont_inherit=True), live.__globals__, namespace)
        value = namespace[live.__name__]  # a decorated source (@property) yields the decorated value
        fn = _function(value)
        setattr(fn, "__zoo_live__", live)  # noqa: B010 (a function's own attribute, which FunctionType does not declare)
        # lets inspect.getsource and tracebacks show the buggy lines
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        return [(self.target, self.method, value)]


def _function(value: object) -> FunctionType:
    """The function behind a class attribute: a property's getter, a static or class method's function."""
    if isinstance(value, property):
        value = value.fget
    elif isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if not isinstance(value, FunctionType):
        raise ZooEditError(f"not a function, a property or a static or class method: {value!r:.80}")
    return value


BUGS: Dict[str, Bug] = {}


def _bug(name: str, origin: str, description: str, target: type | ModuleType, method: str, *edits: Edit) -> None:
    BUGS[name] = Bug(name, origin, description, target, method, edits)


@contextmanager
def patched(name: str | None) -> Iterator[None]:
    """Apply bug `name` (None: no bug) to the fast classes inside the block."""
    if name is None:
        yield
        return
    if name not in BUGS:
        raise KeyError(f"unknown bug {name!r}; known: {', '.join(sorted(BUGS))}")
    saved = []
    try:
        for cls, attr, value in BUGS[name].patches():
            saved.append((cls, attr, cls.__dict__.get(attr, _MISSING)))
            setattr(cls, attr, value)
        yield
    finally:
        for cls, attr, old in reversed(saved):
            if old is _MISSING:
                delattr(cls, attr)
            else:
                setattr(cls, attr, old)


_MISSING = object()


# -- cache_req: the four regions ---------------------------------------------------------------

_bug(
    "no-remap-on-duplicate",
    "kvledger seed review (SGLang remaps req_to_token)",
    "cache_req frees duplicate prefix pages but leaves the running request's row pointing at them",
    fast.CacheManager,
    "cache_req",
    (
        "row[old.cached_len : hit] = new.get_matched_indices()[old.cached_len : hit]",
        "pass  # BUG: the remap of row[old.cached_len:hit] to the cache's copy is missing",
    ),
)

_bug(
    "double-free-on-finish",
    "SGLang (double free of KV on abort/finish)",
    "cache_req(finished=True) frees the tail from the old handle's end: the duplicate region twice "
    "and the just-inserted prefix too",
    fast.CacheManager,
    "cache_req",
    ("self._free(locs[new.cached_len :])", "self._free(locs[old.cached_len :])  # BUG: should start at new.cached_len"),
)

_bug(
    "frees-locked-prefix",
    "SGLang (abort frees the prefix shared with the radix cache)",
    "cache_req frees [0, hit) instead of [old, hit): pages of the prefix the cache still holds go free",
    fast.CacheManager,
    "cache_req",
    ("self._free(locs[old.cached_len : hit])", "self._free(locs[:hit])  # BUG: should be locs[old.cached_len : hit]"),
)

_bug(
    "unlock-wrong-handle",
    "ours (mini-sglang cache_req unlocks old, locks new)",
    "cache_req unlocks the handle it just inserted instead of the one the request held",
    fast.CacheManager,
    "cache_req",
    ("self.unlock(old)", "self.unlock(new)  # BUG: should unlock old"),
)


# -- freeing and allocation --------------------------------------------------------------------

_bug(
    "lazy-free-holds-views",
    "mini-sglang seed (lazy_free_region keeps indices[::page_size])",
    "_free keeps a view of the page-table row; a row remapped before the lazy region ends frees the wrong pages",
    fast.CacheManager,
    "_free",
    ("starts = indices[:: self.page_size].clone()", "starts = indices[:: self.page_size]  # BUG: no .clone()"),
)

_bug(
    "evict-counts-pages",
    "mini-sglang / SGLang paged allocator (evict(num_pages) vs tokens)",
    "_allocate asks the prefix cache to evict the page shortfall as if it were tokens",
    fast.CacheManager,
    "_allocate",
    (
        "self.prefix_cache.evict((needed_pages - free) * self.page_size)",
        "self.prefix_cache.evict(needed_pages - free)  # BUG: size is in tokens",
    ),
)

_bug(
    "free-list-lifo",
    "ours (vLLM's free block queue is FIFO for prefix reuse)",
    "_allocate hands out the most recently freed pages first (pops the back of free_slots)",
    fast.CacheManager,
    "_allocate",
    (
        "allocated = self.free_slots[:needed_pages]",
        "allocated = self.free_slots[len(self.free_slots) - needed_pages :]  # BUG: the back, not the front",
    ),
    (
        "self.free_slots = self.free_slots[needed_pages:]",
        "self.free_slots = self.free_slots[: len(self.free_slots) - needed_pages]  # BUG: keeps the front",
    ),
)

_bug(
    "allocate-floor-pages",
    "ours (nano-vllm / vLLM block-count off-by-one at a page boundary)",
    "allocate_paged rounds device_len down to a page: the partial last page is never allocated",
    fast.CacheManager,
    "allocate_paged",
    ("div_ceil(req.device_len, ps) * ps", "req.device_len // ps * ps  # BUG: floor"),
)

_bug(
    "match-whole-prompt",
    "nano-vllm / vLLM (full prompt cache hit leaves no token to compute)",
    "match_req matches the whole prompt, so cached_len can reach input_len and nothing is computed",
    fast.CacheManager,
    "match_req",
    ("req.input_ids[: req.input_len - 1])", "req.input_ids[: req.input_len])  # BUG: not input_len - 1"),
)

_bug(
    "available-ignores-evictable",
    "mini-sglang seed (available_size must count evictable)",
    "available_size counts only free pages, so admission rejects requests the cache could make room for",
    fast.CacheManager,
    "available_size",
    (" + self.prefix_cache.size_info.evictable_size", "  # BUG: + evictable_size is missing"),
)


# -- admission ---------------------------------------------------------------------------------

_bug(
    "reservation-in-tokens",
    "mini-sglang seed (worst-case reservation in tokens)",
    "PrefillAdder reserves input_len - cached_len + max_tokens tokens, not whole pages",
    fast.PrefillAdder,
    "_need",
    (
        "return ps * _reserved_pages(self.policy, cached_len, req.input_len, req.input_len + req.output_len, ps)",
        "return req.input_len - cached_len + req.output_len  # BUG: no page rounding",
    ),
)

_bug(
    "inflight-in-tokens",
    "mini-sglang seed (running reservation as remain_len)",
    "DecodeManager.inflight_tokens sums the running requests' remain_len, not their remaining pages",
    fast.DecodeManager,
    "inflight_tokens",
    (
        "return ps * sum(pages(policy, r.cached_len, r.device_len, r.max_device_len, ps) for r in self.running_reqs)",
        "return sum(r.remain_len for r in self.running_reqs)  # BUG: tokens, not pages",
    ),
)

_bug(
    "no-recheck-after-lock",
    "mini-sglang seed (the second check after lock)",
    "_try_allocate_one skips the admission check after locking the hit, which stopped being evictable",
    fast.PrefillAdder,
    "_try_allocate_one",
    # the comment is what tells the recheck from the first check
    (
        "if need + self.reserved_size > cm.available_size:  # the hit is now locked, not evictable",
        "if False:  # BUG: the recheck after locking is gone",
    ),
)

_bug(
    "budget-charges-cached-prefix",
    "SGLang (PrefillAdder charging input_len, not extend_len)",
    "_add_one_req charges the token budget for the cached prefix too, so fewer requests prefill together",
    fast.PrefillAdder,
    "_add_one_req",
    (
        "self.token_budget -= chunk",
        "self.token_budget -= end  # BUG: should be chunk (the cached prefix is not computed)",
    ),
)

_bug(
    "table-slot-leak",
    "ours (SGLang req_to_token_pool slot leak on abort)",
    "TableManager.free marks the slot free but never returns it to the free list",
    fast.TableManager,
    "free",
    ("self._free_slots.append(table_idx)", "# BUG: self._free_slots.append(table_idx) is missing"),
)


# -- the radix tree ----------------------------------------------------------------------------

_bug(
    "lock-skips-own-node",
    "mini-sglang / SGLang (inc_lock_ref starting at the parent)",
    "lock_handle walks from the handle's parent, so the matched node itself stays unlocked and evictable",
    RadixPrefixCache,
    "lock_handle",
    (
        "node = handle.node",
        "node = handle.node.parent if handle.node is not None else None  # BUG: should start at handle.node",
    ),
)

_bug(
    "unlock-skips-evictable-size",
    "SGLang (evictable_size_ drift in dec_lock_ref)",
    "unlocking a node to lock count 0 moves it out of protected_size but never into evictable_size",
    RadixPrefixCache,
    "lock_handle",
    ("self.evictable_size += node.length", "# BUG: self.evictable_size += node.length is missing"),
)

_bug(
    "lock-keeps-heap-entry",
    "ours (lazy-deletion heap of evictable leaves)",
    "locking a node does not invalidate its heap entry, so eviction can take a locked leaf",
    RadixPrefixCache,
    "lock_handle",
    ("node.version += 1", "# BUG: node.version += 1 is missing"),
)

_bug(
    "match-returns-root",
    "SGLang (match_prefix returning the root with a non-zero prefix length)",
    "match_prefix reports the matched length but hands back the root node, so the handle has no path",
    RadixPrefixCache,
    "match_prefix",
    (
        "CacheHandle(matched, node, self.device))",
        "CacheHandle(matched, self.root, self.device))  # BUG: should be node",
    ),
)

_bug(
    "insert-stores-view",
    "SGLang (radix values as views of req_to_token)",
    "insert_prefix stores a view of the page-table row, which changes when the row is reused",
    RadixPrefixCache,
    "insert_prefix",
    (".to(torch.int32).clone(), parent)", ".to(torch.int32), parent)  # BUG: no clone"),
)

_bug(
    "insert-unaligned",
    "SGLang paged radix cache (inserting a partial last page)",
    "insert_prefix keeps the whole key instead of cutting it to whole pages",
    RadixPrefixCache,
    "insert_prefix",
    (
        "length = len(input_ids) - len(input_ids) % self.page_size",
        "length = len(input_ids)  # BUG: should drop len(input_ids) % page_size",
    ),
)

_bug(
    "split-unaligned",
    "SGLang paged radix cache (key match not rounded to page_size)",
    "_walk splits a node where the tokens stop matching, not at the last whole page",
    RadixPrefixCache,
    "_walk",
    ("common -= common % ps", "# BUG: common -= common % ps is missing"),
)

_bug(
    "split-drops-ref-count",
    "SGLang (_split_node copying lock_ref)",
    "_split gives the new head node lock count 0 although the locked tail now hangs below it",
    RadixPrefixCache,
    "_split",
    ("head.ref_count = node.ref_count", "# BUG: head.ref_count = node.ref_count is missing"),
)

_bug(
    "lru-not-touched-on-match",
    "SGLang / vLLM (last_access not refreshed on a prefix hit)",
    "_walk does not stamp the nodes it matches, so a hot prefix is evicted as if never reused",
    RadixPrefixCache,
    "_walk",
    ("child.last_access = self.clock", "# BUG: child.last_access = self.clock is missing"),
)

_bug(
    "lru-evicts-mru",
    "ours (heap key sign flip; vLLM evictor ordering bugs)",
    "the evictable-leaf heap is keyed on -last_access: the most recently used leaf goes first",
    RadixPrefixCache,
    "_changed",
    (
        "(node.last_access, node.id, node.version, node))",
        "(-node.last_access, node.id, node.version, node))  # BUG: sign",
    ),
)


_bug(
    "touch-keeps-heap-entry",
    "ours (lazy-deletion heap of evictable leaves)",
    "_walk stamps the nodes it matches but does not re-enter them in the heap, so an evictable leaf "
    "matched again (by a request turned away before locking it, or by a finished request's insert) "
    "is evicted by its old stamp",
    RadixPrefixCache,
    "_walk",
    ("self._changed(child)", "pass  # BUG: self._changed(child) is missing"),
)

_bug(
    "insert-keeps-parent-heap-entry",
    "ours (lazy-deletion heap of evictable leaves)",
    "insert_prefix does not invalidate the parent's heap entry when an evictable leaf gains a child, "
    "so the heap holds a node that is no longer a leaf",
    RadixPrefixCache,
    "insert_prefix",
    ("self._changed(parent)", "pass  # BUG: self._changed(parent) is missing"),
)


# -- preemption (optimistic admission) ---------------------------------------------------------

_bug(
    "preempt-frees-to-free-list",
    "SGLang retract_decode (frees the uncached suffix and dec_lock_ref; nothing inserted into the radix tree)",
    "preempt releases the victim's lock and frees its own pages to the free list instead of handing "
    "its computed KV to the prefix cache",
    fast.Preemptor,
    "preempt",
    (
        "self.cache_manager.cache_req(req, finished=True)",
        "cm, start = self.cache_manager, req.cache_handle.cached_len\n"
        "    cm.unlock(req.cache_handle)\n"
        "    cm._free(cm.page_table[req.table_idx, start : req.cached_len])  # BUG: should be cache_req(finished=True)",
    ),
)

_bug(
    "preempt-keeps-prefix-lock",
    "SGLang retract (sglang#33783: the radix-owned prefix is only released "
    "through dec_lock_ref; a retract path without it pins the prefix)",
    "preempt frees the victim's own pages but never unlocks the cached prefix it matched",
    fast.Preemptor,
    "preempt",
    (
        "self.cache_manager.cache_req(req, finished=True)",
        "cm, start = self.cache_manager, req.cache_handle.cached_len\n"
        "    cm._free(cm.page_table[req.table_idx, start : req.cached_len])  # BUG: no cache_req, no unlock",
    ),
)

_bug(
    "preempt-frees-whole-row",
    "SGLang retract_decode (the ChunkCache branch frees req_to_token[:seq_len], right only without a radix cache)",
    "preempt frees the victim's whole row, the cached prefix that other requests still map included",
    fast.Preemptor,
    "preempt",
    (
        "self.cache_manager.cache_req(req, finished=True)",
        "cm = self.cache_manager\n"
        "    cm.unlock(req.cache_handle)\n"
        "    cm._free(cm.page_table[req.table_idx, : req.cached_len])  # BUG: from 0, not from the handle's cached_len",
    ),
)

_bug(
    "preempt-double-free",
    "SGLang / sglang-jax (sglang#12224, sglang-jax#994: KV release on scattered paths frees the same slots twice)",
    "preempt hands the KV to the cache with cache_req and then also frees the victim's uncached pages",
    fast.Preemptor,
    "preempt",
    (
        "self.cache_manager.cache_req(req, finished=True)",
        "self.cache_manager.cache_req(req, finished=True)\n"
        "    start = req.cache_handle.cached_len\n"
        "    self.cache_manager._free(self.cache_manager.page_table[req.table_idx, start : req.cached_len])"
        "  # BUG: cache_req already freed or cached these",
    ),
)

_bug(
    "resume-from-prompt",
    "vLLM plugins (vllm-gaudi#524, vllm-ascend#11334: a preempted sequence re-prefilled from its prompt tokens only)",
    "resumed rebuilds the waiting request from the prompt alone: the output generated so far is dropped "
    "and the full max_tokens allowed again",
    fast.Preemptor,
    "resumed",
    (
        "ids = req.input_ids.clone()  # the request's buffer is not ours to keep",
        "ids = req.input_ids[: req.max_device_len - req.sampling_params.max_tokens].clone()  # BUG: the prompt only",
    ),
)

_bug(
    "resume-keeps-max-tokens",
    "ours (vLLM / nano-vllm count max_tokens against all completion tokens; a resume that restarts the count)",
    "resumed keeps the original max_tokens although the output so far is now part of the prompt",
    fast.Preemptor,
    "resumed",
    (
        "max_tokens=req.max_device_len - len(ids)))",
        "max_tokens=req.sampling_params.max_tokens))  # BUG: should be max_device_len - len(ids)",
    ),
)

_bug(
    "resume-drops-inflight-token",
    "ours (the last sampled token has no KV yet: commit 0765986 patches a "
    "victim's in-flight token into its waiting request)",
    "resumed rebuilds from the tokens with KV only, losing the last sampled token",
    fast.Preemptor,
    "resumed",
    (
        "ids = req.input_ids.clone()  # the request's buffer is not ours to keep",
        "ids = req.input_ids[: req.cached_len].clone()  # BUG: drops the in-flight token",
    ),
)

_bug(
    "preempt-oldest-first",
    "nano-vllm (Scheduler preempts running.pop(), the newest; popleft takes the oldest)",
    "make_room picks victims oldest first",
    fast.Preemptor,
    "make_room",
    ("newest_first = list(live)[::-1]", "newest_first = list(live)  # BUG: oldest first"),
)

_bug(
    "victim-still-counted",
    "vLLM v1 scheduler (a preempted request must leave scheduled_running_reqs before the next allocation is tried)",
    "make_room keeps counting a victim of the step's own batch in the pages the step needs, so it "
    "preempts more than it must",
    fast.Preemptor,
    "make_room",
    ("keep.pop(id(victim), None)", "pass  # BUG: keep.pop(id(victim), None) is missing"),
)

_bug(
    "optimistic-ratio-of-whole-length",
    "ours (SGLang new_token_ratio applied to max_new_tokens, not to what is left)",
    "_reserved_pages applies the optimistic ratio to the whole max_device_len, not to the output still allowed",
    fast.admission,
    "_reserved_pages",
    ("remaining = max_device_len - device_len", "remaining = max_device_len  # BUG: should subtract device_len"),
)

_bug(
    "optimistic-no-next-token",
    "ours (vLLM / nano-vllm reserve the next decode slot: can_append)",
    "_reserved_pages drops the minimum of one token, so with a small ratio a request never reserves its "
    "next token's page",
    fast.admission,
    "_reserved_pages",
    (
        "end = device_len + (max(grow, 1) if remaining > 0 else 0)",
        "end = device_len + grow  # BUG: at least one more token while the request may grow",
    ),
)

_bug(
    "needed-size-in-tokens",
    "ours (vLLM's can_append_slots counts new blocks, not tokens; SGLang "
    "check_decode_mem in tokens without page rounding)",
    "needed_size counts the step's new tokens, not the whole pages they start, so preemption stops too early",
    fast.CacheManager,
    "needed_size",
    (
        "return sum(div_ceil(r.device_len, ps) * ps - div_ceil(r.cached_len, ps) * ps for r in reqs)",
        "return sum(r.device_len - r.cached_len for r in reqs)  # BUG: tokens, not whole pages",
    ),
)


# -- the queue the victims wait in (the cache scheduler both implementations share) ------------

_bug(
    "requeue-victims-reversed",
    "vLLM v1 Scheduler (victims are popped from running newest first and each prepended to waiting; "
    "collecting a step's victims and prepending them as one batch keeps the pop order)",
    "the step's victims are requeued oldest first, each at the head, so the newest victim resumes ahead "
    "of an older one admitted before it. The requeue order is decided by the cache scheduler "
    "(`CacheScheduler.allocate` walking `Preemptor.make_room`'s victims), not by fast, whose `make_room` "
    "must return the victims newest first (6-preemption-order) and whose `resumed` only rebuilds one "
    "request: the edit is there, so both sides of lockstep run it and only 10-queue-order can see it",
    CacheScheduler,
    "allocate",
    (
        "for victim in victims:",
        "for victim in victims[::-1]:  # BUG: oldest first; each goes to the head, so the newest resumes first",
    ),
)


# -- speculative decoding: the lookahead and its rollback (fast's Req and CacheManager) --------
# Caught by the speculating lockstep run (`kvledger check --speculate`, which `--bug` turns on for
# these): a bug here changes nothing a run without drafts does.

_bug(
    "spec-draft-room-no-bonus",
    "SGLang (speculative allocation sized for the drafts but not the bonus token near max_new_tokens)",
    "draft_room lets a request verify as many drafts as it has tokens left, with no room for the bonus "
    "token: the lookahead runs one position past the worst case admission reserved",
    fast.Req,
    "draft_room",
    (
        "return max(self.max_device_len - self.device_len - 1, 0)",
        "return max(self.max_device_len - self.device_len, 0)  # BUG: no room kept for the bonus token",
    ),
)

_bug(
    "spec-propose-no-lookahead",
    "SGLang (EAGLE draft slots not allocated ahead: out_cache_loc sized for one token per request)",
    "propose records the drafts but does not count them in device_len, so allocation gives the "
    "drafts' positions no pages and verification commits from the wrong base",
    fast.Req,
    "propose",
    ("self.device_len += len(self.drafts)", "pass  # BUG: the drafts' positions get no locations"),
)

_bug(
    "spec-verify-commits-rejected",
    "vLLM (rejected tokens counted as computed: num_computed_tokens not rolled back after rejection)",
    "verify commits the KV of every draft, the rejected ones too",
    fast.Req,
    "verify",
    ("self.cached_len = base + accepted", "self.cached_len = base + k  # BUG: rejected drafts committed too"),
)

_bug(
    "spec-verify-bonus-first",
    "ours (the bonus token appended before the accepted drafts)",
    "verify appends the bonus token ahead of the accepted drafts: the tokens no longer match the KV "
    "the step wrote for the drafts",
    fast.Req,
    "verify",
    (
        "for token in self.drafts[:accepted] + [int(bonus)]:",
        "for token in [int(bonus)] + self.drafts[:accepted]:  # BUG: bonus before the accepted drafts",
    ),
)

_bug(
    "spec-release-rounds-commit-down",
    "SGLang (spec rollback frees from the page of the committed length rounded down, #7041-style "
    "off-by-one in free of over-allocated slots)",
    "release_rejected rounds the committed length down to a page: it frees the page holding the last "
    "committed positions, which the request still uses",
    fast.CacheManager,
    "release_rejected",
    ("lo = div_ceil(req.cached_len, ps) * ps", "lo = req.cached_len // ps * ps  # BUG: rounds down"),
)

_bug(
    "spec-release-rounds-reserve-down",
    "SGLang (over-allocated speculative slots leaked on rollback: the last partial page kept)",
    "release_rejected rounds the end of the lookahead down to a page: the last, partly used lookahead "
    "page is never freed (a leak)",
    fast.CacheManager,
    "release_rejected",
    ("hi = div_ceil(reserved_end, ps) * ps", "hi = reserved_end // ps * ps  # BUG: rounds down"),
)

# the bugs only a speculating run reaches (`checker/targets.lockstep_target` turns speculation on for them)
SPECULATION_BUGS = frozenset(name for name in BUGS if name.startswith("spec-"))
