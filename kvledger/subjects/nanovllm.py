"""nano-vllm's `BlockManager` as a kvledger subject (a checkout or snapshot of github.com/GeeeekExplorer/nano-vllm).

The adapter loads three files of the checkout, `nanovllm/sampling_params.py`,
`nanovllm/engine/sequence.py` and `nanovllm/engine/block_manager.py`, by path and under module
names unique to that checkout: the package's `__init__` (which imports triton and the model
runner) never runs, and two versions (the fixed bb823b3 and the buggy f64d821) live side by
side in one process. Each protocol call becomes the calls nano-vllm's own
`nanovllm/engine/scheduler.py` makes (`Scheduler.schedule`, `postprocess`, `preempt`), in the
same order, on real `Sequence` objects.

What nano-vllm does that the driver must know (the capabilities): the blocks for a whole prompt
are allocated at admission, so a later chunk never fails; a decode step that finds no free block
preempts the newest running sequence; only the first sequence of a prefill batch may be chunked;
cached blocks nobody uses stay in the free queue and the oldest free block is reused (no
explicit eviction); a block's hash is published right after the step that completes it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import sys
import threading
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Hashable, List, Sequence, Set, Tuple

from kvledger.properties.subject import (
    CachedEntry,
    Capabilities,
    DriverMismatch,
    SubjectConfig,
    SubjectUnavailable,
    View,
)
from kvledger.subjects.edits import EditError, SourceEdit, bind, edited_function
from kvledger.subjects.peers import checkout, commit_of

log = logging.getLogger(__name__)

NAME = "nanovllm"
PEER = "nano-vllm"  # the shipped snapshots are nano-vllm-<commit>.tar.gz
DEFAULT_COMMIT = "bb823b3"  # "fix cache hit": the fixed HEAD
BUGGY_COMMIT = "f64d821"  # the commit before it: a hit on a free cached block loses its hash
# may_append adds a block when `len(seq) % block_size == 1`, which never holds for a block size of 1
# (nano-vllm itself asserts a multiple of 256); 2 is the smallest size its code handles
MIN_PAGE_SIZE = 2
XXHASH_PIN = "xxhash==4.1.0"
INSTALL = f"pip install {XXHASH_PIN}"

BLOCK_MANAGER = "nanovllm.engine.block_manager"  # the zoo's target module, as nano-vllm names it
SEQUENCE = "nanovllm.engine.sequence"
_FILES: Tuple[Tuple[str, str], ...] = (  # (nano-vllm's module name, file), in import order
    ("nanovllm.sampling_params", "nanovllm/sampling_params.py"),
    (SEQUENCE, "nanovllm/engine/sequence.py"),
    (BLOCK_MANAGER, "nanovllm/engine/block_manager.py"),
)


@dataclass(frozen=True)
class _Checkout:
    root: Path
    commit: str
    modules: Dict[str, types.ModuleType]  # nano-vllm's module name -> this checkout's copy

    @property
    def block_manager(self) -> types.ModuleType:
        return self.modules[BLOCK_MANAGER]

    @property
    def sequence(self) -> types.ModuleType:
        return self.modules[SEQUENCE]


_loaded: Dict[Path, _Checkout] = {}
_lock = threading.Lock()


def _missing_files(root: Path) -> List[str]:
    return [rel for _, rel in _FILES if not (root / rel).is_file()]


def _load(root: Path) -> _Checkout:
    """This checkout's three modules, loaded once per process under names of their own."""
    root = root.resolve()
    with _lock:
        if root in _loaded:
            return _loaded[root]
        missing = _missing_files(root)
        if missing:
            raise SubjectUnavailable(f"nanovllm: {root} is not a nano-vllm checkout (no {', '.join(missing)})")
        if importlib.util.find_spec("xxhash") is None:
            raise SubjectUnavailable(f"nanovllm: the xxhash package is missing: {INSTALL}")
        tag = hashlib.sha256(str(root).encode()).hexdigest()[:12]
        # The files import each other by nano-vllm's absolute names (`from nanovllm.engine.sequence
        # import Sequence`): while they execute, those names (and empty parent packages, so the real
        # `nanovllm/__init__` never runs) point at this checkout's copies; then sys.modules is put
        # back, and each copy keeps the classes it imported in its own globals.
        shadowed = ["nanovllm", "nanovllm.engine"] + [name for name, _ in _FILES]
        saved = {name: sys.modules.get(name) for name in shadowed}
        modules: Dict[str, types.ModuleType] = {}
        try:
            for package in ("nanovllm", "nanovllm.engine"):
                stub = types.ModuleType(package)
                stub.__path__ = []  # a package that finds no submodule on its own
                sys.modules[package] = stub
            for name, rel in _FILES:
                unique = f"_kvledger_nanovllm_{tag}_{name.rsplit('.', 1)[-1]}"
                spec = importlib.util.spec_from_file_location(unique, root / rel)
                if spec is None or spec.loader is None:
                    raise ImportError(f"no module at {root / rel}")
                module = importlib.util.module_from_spec(spec)
                sys.modules[unique] = module  # inspect (the zoo's edits) finds it by this name
                sys.modules[name] = module
                spec.loader.exec_module(module)
                modules[name] = module
        except ImportError as e:
            raise SubjectUnavailable(f"nanovllm: importing {root}: {e} ({INSTALL})") from None
        finally:
            for name, before in saved.items():
                if before is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = before
        found = _Checkout(root, commit_of(root), modules)
        _loaded[root] = found
        log.debug("nanovllm %s loaded from %s", found.commit, root)
        return found


def probe(path: str | None = None) -> Tuple[bool, str, str]:
    """(installed, version, detail): the checkout (unpacked once when a snapshot) and xxhash."""
    try:
        root = checkout(PEER, path, DEFAULT_COMMIT)
    except SubjectUnavailable as e:
        return False, "", str(e)
    missing = _missing_files(root)
    if missing:
        return False, "", f"{root} is not a nano-vllm checkout (no {', '.join(missing)})"
    commit = commit_of(root)
    if importlib.util.find_spec("xxhash") is None:
        return False, commit, f"the xxhash package is missing: {INSTALL}"
    return True, commit, f"nano-vllm {commit} at {root}"


def build(config: SubjectConfig, path: str | None = None, edits: Sequence[SourceEdit] = ()) -> "NanoVllmSubject":
    if config.page_size < MIN_PAGE_SIZE:
        raise SubjectUnavailable(
            f"nanovllm: page size {config.page_size} is below {MIN_PAGE_SIZE}: its may_append "
            "never adds a block when block_size is 1 (nano-vllm asserts a multiple of 256)"
        )
    return NanoVllmSubject(config, _load(checkout(PEER, path, DEFAULT_COMMIT)), edits)


class NanoVllmSubject:
    """One `BlockManager` and its live `Sequence`s, driven as `Scheduler` drives them."""

    name = NAME

    def __init__(self, config: SubjectConfig, source: _Checkout, edits: Sequence[SourceEdit] = ()) -> None:
        self.version = source.commit
        self.source = source
        bs = self.block_size = config.page_size
        # Sequence.block_size is a class attribute (LLMEngine sets it once per process). A subclass
        # per subject carries this subject's page size, so subjects of other page sizes, in this
        # process or of another checkout, never change it under this one; nano-vllm reads it only
        # as `self.block_size`, and the block manager keeps its own copy.
        self._seq_class = type("Sequence", (source.sequence.Sequence,), {"block_size": bs, "__module__": __name__})
        self._params = source.modules["nanovllm.sampling_params"].SamplingParams
        # nano-vllm reserves no block: every block id is a usable page
        self.bm = source.block_manager.BlockManager(config.num_pages, bs)
        # the key of a prefix, always with the pristine hash (an edit bound on `bm` cannot hide
        # behind it): the classmethod of this checkout's BlockManager
        self._compute_hash = source.block_manager.BlockManager.compute_hash
        self._bind(edits)
        self.capabilities = Capabilities(
            page_size=bs,
            pages=tuple(range(config.num_pages)),
            worst_case_admission=False,
            preempts=True,
            explicit_evict=False,
            cached_pages_in_free_pool=True,
            chunked_prefill=True,
            chunk_only_first=True,
            prefill_publishes_to_cache=True,
        )
        self.seqs: Dict[int, Any] = {}  # uid -> its nano-vllm Sequence, from submit until it ends
        self.live: Dict[int, None] = {}  # admitted uids, in admission order
        self.prefilling: Set[int] = set()  # admitted and its prompt not yet computed (nano: not RUNNING)

    def _bind(self, edits: Sequence[SourceEdit]) -> None:
        for edit in edits:
            module, path = edit.split()
            if module == BLOCK_MANAGER and len(path) == 2 and path[0] == "BlockManager":
                bind(self.bm, [edit], self.source.block_manager)
            elif module == SEQUENCE and len(path) == 2 and path[0] == "Sequence":
                # on this subject's own subclass, never on nano-vllm's Sequence
                setattr(self._seq_class, path[1], edited_function(edit, self.source.sequence))
            else:
                raise EditError(
                    f"{edit.name}: nanovllm edits target {BLOCK_MANAGER}:BlockManager.* or "
                    f"{SEQUENCE}:Sequence.*, not {edit.target}"
                )

    # -- the protocol --------------------------------------------------------------------------
    def submit(self, uid: int, prompt: Sequence[int], max_tokens: int) -> None:
        # ints, not numpy scalars: compute_hash hashes np.array(token_ids).tobytes(), so the dtype
        # is part of the key
        tokens = [int(t) for t in prompt]
        self.seqs[uid] = self._seq_class(tokens, self._params(max_tokens=max_tokens))

    def admit(self, uid: int, budget: int) -> int | None:
        # Scheduler.schedule, prefill loop, for a sequence with no block table: `remaining == 0`
        # ends the walk; can_allocate (-1: refused, nothing changed); then allocate, which takes
        # blocks for the WHOLE sequence (its prompt, or after a preemption prompt + output) at once
        seq = self.seqs[uid]
        if budget <= 0:
            return None
        num_cached_blocks = self.bm.can_allocate(seq)
        if num_cached_blocks == -1:
            return None
        self.bm.allocate(seq, num_cached_blocks)
        self.live[uid] = None
        self.prefilling.add(uid)
        return seq.num_cached_tokens

    def allocate(self, uid: int, start: int, end: int) -> bool:
        seq = self.seqs[uid]
        if uid in self.prefilling:
            # Scheduler.schedule, prefill: the blocks exist since admission; a chunk only sets
            # num_scheduled_tokens (from num_cached_tokens, at most the rest of the sequence)
            if start != seq.num_cached_tokens or not start < end <= len(seq):
                raise DriverMismatch(
                    f"uid {uid}: prefill [{start}, {end}) but nano-vllm has computed "
                    f"{seq.num_cached_tokens} of {len(seq)} tokens"
                )
            seq.num_scheduled_tokens = end - start
            return True
        # Scheduler.schedule, decode loop: can_append, else preempt (the driver preempts the newest
        # live request and calls again); then may_append, which adds a block when the last token
        # starts one
        if (start, end) != (len(seq) - 1, len(seq)):
            raise DriverMismatch(f"uid {uid}: decode [{start}, {end}) but the sequence has {len(seq)} tokens")
        if not self.bm.can_append(seq):
            return False
        seq.num_scheduled_tokens = 1
        seq.is_prefill = False
        self.bm.may_append(seq)
        return True

    def computed(self, uid: int, start: int, end: int, token: int | None) -> None:
        # Scheduler.postprocess: hash_blocks (publishes the blocks this step completed) before
        # num_cached_tokens advances; the sampled token is appended once the prompt is done.
        # nano-vllm deallocates a finished sequence inside the same loop, before the next
        # sequence's hash_blocks; the driver's finish comes after the whole batch, which touches
        # the same structures in the same way (hashing moves no block between free and used).
        seq = self.seqs[uid]
        if start != seq.num_cached_tokens or end - start != seq.num_scheduled_tokens:
            raise DriverMismatch(
                f"uid {uid}: computed [{start}, {end}) but nano-vllm scheduled "
                f"{seq.num_scheduled_tokens} tokens from {seq.num_cached_tokens}"
            )
        self.bm.hash_blocks(seq)
        seq.num_cached_tokens += seq.num_scheduled_tokens
        seq.num_scheduled_tokens = 0
        if uid in self.prefilling:
            if seq.num_cached_tokens < seq.num_tokens:
                return
            self.prefilling.discard(uid)  # nano-vllm: status RUNNING
        if token is not None:
            seq.append_token(int(token))

    def finish(self, uid: int) -> None:
        # Scheduler.postprocess: a finished sequence is deallocated
        self.bm.deallocate(self.seqs[uid])
        self._forget(uid)

    def abort(self, uid: int) -> None:
        # nano-vllm has no abort; dropping a sequence can only mean deallocating what it holds
        if uid in self.live:
            self.bm.deallocate(self.seqs[uid])
        self._forget(uid)

    def preempt(self, uid: int) -> None:
        # Scheduler.preempt: deallocate and back to the waiting queue's head, keeping its
        # token_ids (prompt + output): can_allocate then matches and allocate takes blocks for all
        # of them, and its whole sequence is prefilled again (its own blocks, back in the free
        # queue with their hashes, are hit if nothing reused them)
        seq = self.seqs[uid]
        seq.is_prefill = True
        self.bm.deallocate(seq)
        self.live.pop(uid, None)
        self.prefilling.discard(uid)

    def evict(self, tokens: int) -> int:
        return 0  # no explicit eviction: the oldest free block is reused by _allocate_block

    def _forget(self, uid: int) -> None:
        self.seqs.pop(uid, None)
        self.live.pop(uid, None)
        self.prefilling.discard(uid)

    # -- what the judge reads --------------------------------------------------------------------
    def view(self) -> View:
        bm, bs = self.bm, self.block_size
        requests: Dict[int, List[int]] = {}
        for uid in self.live:
            seq = self.seqs[uid]
            table = seq.block_table
            # the positions its block table covers (after a decode step appends the next token,
            # that token's block comes with the next may_append); nano-vllm's model runner maps
            # position p to slot block_table[p // bs] * bs + p % bs
            held = min(len(seq), len(table) * bs)
            requests[uid] = [table[p // bs] * bs + p % bs for p in range(held)]
        # A block's own hash says what it is cached as; hash_to_block_id keeps only the last
        # block filed under a hash, so a shared block whose duplicate was filed after it is still
        # cached (a later hit finds the duplicate). A map entry pointing at a block that does not
        # carry its hash is an entry of its own: the judge then sees the page cached twice.
        cached = [
            CachedEntry(
                locations=tuple(range(block.block_id * bs, block.block_id * bs + bs)),
                start=None,
                key=block.hash,
                lock=None,
                name=f"block {block.block_id}",
            )
            for block in bm.blocks
            if block.hash != -1
        ] + [
            CachedEntry(
                locations=tuple(range(block_id * bs, block_id * bs + bs)),
                start=None,
                key=h,
                lock=None,
                name=f"hash_to_block_id entry of block {block_id}",
            )
            for h, block_id in bm.hash_to_block_id.items()
            if bm.blocks[block_id].hash != h
        ]
        return View(
            free=list(bm.free_block_ids),
            requests=requests,
            cached=cached,
            page_refs={block.block_id: block.ref_count for block in bm.blocks},
            counters={"free_pages": len(bm.free_block_ids), "used_pages": len(bm.used_block_ids)},
        )

    def cache_key(self, tokens: Sequence[int]) -> Hashable:
        """What hash_blocks files the prefix's last full block under: compute_hash chained over
        its full blocks from -1 (None when it has no full block)."""
        bs = self.block_size
        h = -1
        for i in range(len(tokens) // bs):
            h = self._compute_hash([int(t) for t in tokens[i * bs : (i + 1) * bs]], h)
        return None if h == -1 else h


def _edit(name: str, method: str, old: str, new: str, why: str) -> SourceEdit:
    return SourceEdit(name, f"{BLOCK_MANAGER}:BlockManager.{method}", old, new, why)


# Single edits to bb823b3's BlockManager (texts as in the method's dedented source).
ZOO: Tuple[SourceEdit, ...] = (
    _edit(
        "nanovllm-deallocate-skips-first",
        "deallocate",
        "reversed(seq.block_table)",
        "reversed(seq.block_table[1:])",
        "an off-by-one slice when walking the table backwards: the first block of every finished or "
        "preempted sequence keeps its reference and never returns to the free queue (a leak)",
    ),
    _edit(
        "nanovllm-can-allocate-counts-last-block",
        "can_allocate",
        "range(seq.num_blocks - 1)",
        "range(seq.num_blocks)",
        "matching the last block too: a prompt of whole blocks that is fully cached is admitted with "
        "nothing left to compute, so no forward pass produces its next token's logits",
    ),
    _edit(
        "nanovllm-can-allocate-free-hit-costs-nothing",
        "can_allocate",
        "if block_id in self.used_block_ids:\n            num_new_blocks -= 1",
        "num_new_blocks -= 1",
        "treating every hit as free of cost, though a hit on a cached block in the free queue takes "
        "that block out of it: admission overcommits and allocate pops an empty queue",
    ),
    _edit(
        "nanovllm-hash-parent-off-by-one",
        "hash_blocks",
        "seq.block_table[start - 1]",
        "seq.block_table[start]",
        "chaining a step's first new block from itself (still unhashed) instead of the block before "
        "it: after a chunk boundary or a prefix hit, the block is filed as if it started a prompt",
    ),
    _edit(
        "nanovllm-may-append-late",
        "may_append",
        "% self.block_size == 1",
        "% self.block_size == 0",
        "the new-block test off by one: the token that starts a block gets none, and the model "
        "runner writes its KV into the previous block",
    ),
    _edit(
        "nanovllm-shared-hit-resets-ref",
        "allocate",
        "block.ref_count += 1",
        "block.ref_count = 1",
        "a hit on a block in use sets its reference count instead of incrementing it: the first of "
        "its holders to finish frees it under the others",
    ),
    _edit(
        "nanovllm-free-keeps-used",
        "_deallocate_block",
        "self.used_block_ids.remove(block_id)",
        "pass",
        "freeing a block without taking it out of the used set: a later hit on it counts as shared, "
        "so it stays in the free queue while a sequence holds it",
    ),
    _edit(
        "nanovllm-reuse-keeps-stale-hash",
        "_allocate_block",
        "del self.hash_to_block_id[block.hash]",
        "pass",
        "handing a cached block out again without unfiling its hash: the map keeps pointing at a "
        "block whose KV is overwritten by another prefix",
    ),
)

# Upstream-style fixes of known bugs, for the commits that have them. At f64d821 a hit on a cached
# block in the free queue goes through _allocate_block, which resets the block's hash and drops its
# map entry ("fix cache hit", bb823b3, takes the block out of the free queue in place instead).
FIXES: Dict[str, Tuple[SourceEdit, ...]] = {
    "nanovllm-f64d821-hit-resets-free-block": (
        _edit(
            "nanovllm-f64d821-fix-cache-hit",
            "allocate",
            "else:\n            self._allocate_block(block_id)",
            "else:\n            block.ref_count = 1\n            self.free_block_ids.remove(block_id)\n"
            "            self.used_block_ids.add(block_id)",
            "bb823b3's fix: a hit on a free cached block keeps its hash (f64d821 only)",
        ),
    ),
}
