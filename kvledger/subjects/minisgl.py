"""mini-sglang 20fcd7f: `minisgl.scheduler.cache.CacheManager` over its radix cache, driven by the
adapter for its API (`minisgl_api.py`) with its own `PrefillAdder`, `TableManager` and `DecodeManager`.

The spec path is a checkout directory or a `.tar.gz` snapshot of one (the shipped peer
`mini-sglang-20fcd7f.tar.gz`); its `python/` goes on `sys.path`. Importing the scheduler's modules
needs msgpack, pyzmq and apache-tvm-ffi (the radix cache's key compare is a C++ function that
tvm-ffi compiles with g++ on first use), not flashinfer, triton or sgl_kernel.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, List, Sequence, Tuple

import torch
from torch.overrides import TorchFunctionMode

from kvledger.properties.subject import Capabilities, SubjectConfig, SubjectUnavailable
from kvledger.subjects.edits import SourceEdit
from kvledger.subjects.minisgl_api import MinisglApiModules, MinisglApiSubject, radix_entries
from kvledger.subjects.peers import cache_dir, checkout, commit_of, peer_path

log = logging.getLogger(__name__)

NAME = "minisgl"
PEER = "mini-sglang"
COMMIT = "20fcd7f"
INSTALL = "pip install --no-deps msgpack==1.2.4 pyzmq==27.3.0 apache-tvm-ffi==0.1.11"
_SOURCE = "python/minisgl/scheduler/cache.py"
_IMPORTS = {"msgpack": "msgpack", "zmq": "pyzmq", "tvm_ffi": "apache-tvm-ffi"}


def _version(found: Path) -> str:
    if found.is_dir():
        return commit_of(found)
    name = found.name.split(".tar")[0].split(".tgz")[0]  # mini-sglang-<commit>.tar.gz
    return name[len(PEER) + 1 :] if name.startswith(PEER + "-") else "unknown"


def probe(path: str | None = None) -> Tuple[bool, str, str]:
    found = Path(path).expanduser() if path else peer_path(PEER, COMMIT)
    if found is None or not found.exists():
        return (
            False,
            "",
            (
                f"no {PEER} checkout: pass {NAME}:PATH (a checkout or {PEER}-{COMMIT}.tar.gz) "
                f"or put the snapshot in $KVLEDGER_PEERS"
            ),
        )
    if found.is_dir() and not (found / _SOURCE).is_file():
        return False, "", f"{found}: not a mini-sglang checkout (no {_SOURCE})"
    version = _version(found)
    missing = [pkg for module, pkg in _IMPORTS.items() if importlib.util.find_spec(module) is None]
    if missing:
        return False, version, f"{PEER} needs {', '.join(missing)}: {INSTALL}"
    return True, version, str(found)


def _load(path: str | None) -> Tuple[Path, SimpleNamespace]:
    root = checkout(PEER, path, COMMIT)
    src = root / "python"
    if not (root / _SOURCE).is_file():
        raise SubjectUnavailable(f"{root}: not a mini-sglang checkout (no {_SOURCE})")
    loaded = sys.modules.get("minisgl")
    if loaded is not None:
        where = Path(next(iter(loaded.__path__))).resolve().parent  # a namespace package: no __init__
        if where != src.resolve() and commit_of(where.parent) != commit_of(root):
            raise SubjectUnavailable(
                f"minisgl is already imported from {where} in this process; one mini-sglang version per process"
            )
    elif str(src) not in sys.path:
        sys.path.insert(0, str(src))
    # tvm-ffi builds the radix key compare under its cache dir: keep it beside kvledger's own cache
    os.environ.setdefault("TVM_FFI_CACHE_DIR", str(cache_dir().parent / "tvm-ffi"))
    try:
        mods = {
            name: importlib.import_module(f"minisgl.{name}")
            for name in (
                "core",
                "scheduler.cache",
                "scheduler.prefill",
                "scheduler.decode",
                "scheduler.table",
                "scheduler.utils",
            )
        }
    except ImportError as e:
        raise SubjectUnavailable(f"{PEER} at {root} does not import ({e}); {INSTALL}") from e
    return root, SimpleNamespace(**{k.rsplit(".", 1)[-1]: v for k, v in mods.items()})


class _NoPinning(TorchFunctionMode):
    """mini-sglang stages its host-to-device copies in pinned memory (`torch.empty(...,
    pin_memory=True)` in `cache._write_page_table`, `.pin_memory()` in `PrefillAdder`), and a
    CPU-only torch has no pinned allocator: it raises. Every tensor here stays on the host, where
    pinning changes nothing, so while the adapter is inside mini-sglang's code (and only then) a
    pinning request is dropped; nothing else is changed, and no file."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.pin_memory:
            return args[0]
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)


def _set_page_size(core: Any, page_size: int) -> None:
    """The radix cache reads the page size from the global context, once, in its constructor;
    the context can be set once per process, so a later subject updates its page size."""
    if core._GLOBAL_CTX is None:
        core.set_global_ctx(core.Context(page_size=page_size))
    else:
        core.get_global_ctx().page_size = page_size


def _modules(m: SimpleNamespace) -> MinisglApiModules:
    def managers(config: SubjectConfig):
        ps, max_running = config.page_size, config.max_running_req
        # Engine.__init__: one more row for the dummy request, rows aligned to 32 entries (here also
        # to whole pages, which the engine's power-of-two page sizes always are)
        width = -(-(-(-config.max_seq_len // 32) * 32) // ps) * ps
        page_table = torch.zeros((max_running + 1, width), dtype=torch.int32)
        page_table[max_running].fill_(config.num_pages * ps)  # the dummy row points at the dummy page past the pool
        _set_page_size(m.core, ps)
        cm = m.cache.CacheManager(config.num_pages, ps, page_table, "radix")
        return cm, m.table.TableManager(max_running, page_table), m.decode.DecodeManager(ps)

    def pending(uid: int, prompt: Sequence[int], max_tokens: int) -> Any:
        ids = torch.tensor(list(prompt), dtype=torch.int32)  # a UserMsg's input_ids: CPU int32
        return m.utils.PendingReq(uid, ids, m.core.SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    def cached(cache: Any) -> List:
        return radix_entries(
            cache.root_node,
            lambda n: list(n.children.values()),
            lambda n: n._key.tolist(),
            lambda n: n.value.tolist(),
            lambda n: n.ref_count,
            lambda n: f"node {n.uuid}",
        )

    return MinisglApiModules(
        PrefillAdder=m.prefill.PrefillAdder,
        ChunkedReq=m.prefill.ChunkedReq,
        managers=managers,
        pending=pending,
        token=lambda t: torch.tensor([t], dtype=torch.int32),  # next_tokens_cpu[i].unsqueeze(0)
        tolist=lambda x: x.tolist(),
        cached=cached,
        calls=_NoPinning,
    )


def build(config: SubjectConfig, path: str | None = None, edits: Sequence[SourceEdit] = ()) -> MinisglApiSubject:
    root, m = _load(path)
    caps = Capabilities(
        page_size=config.page_size,
        pages=tuple(range(config.num_pages)),
        worst_case_admission=True,  # PrefillAdder reserves extend + output against available_size
        preempts=False,
        explicit_evict=True,
        cached_pages_in_free_pool=False,
    )
    log.debug("mini-sglang %s from %s", commit_of(root), root)
    return MinisglApiSubject(NAME, commit_of(root), caps, _modules(m), config, edits)


_CACHE = "minisgl.scheduler.cache:CacheManager"
_RADIX = "minisgl.kvcache.radix_cache:RadixPrefixCache"
_ADDER = "minisgl.scheduler.prefill:PrefillAdder"

# Upstream PR #142 (open at 20fcd7f): cache_req(finished=False) frees the request's copies of a
# prefix another request inserted meanwhile, and the request's row still points at them. The fix
# points the row at the cache's pages; the freed slice is copied first, since inside
# lazy_free_region `_free` keeps a view of the row until the region ends.
FIXES = {
    "pr142": (
        SourceEdit(
            "pr142-remap-row",
            f"{_CACHE}.cache_req",
            "self._free(page_indices[old_handle.cached_len : cached_len])",
            "duplicates = page_indices[old_handle.cached_len : cached_len].clone()\n"
            "    if not finished and cached_len > old_handle.cached_len:  # it reads the cache's copies from now on\n"
            "        matched = new_handle.get_matched_indices()\n"
            "        page_indices[old_handle.cached_len : cached_len] = matched[old_handle.cached_len : cached_len]\n"
            "    self._free(duplicates)",
            "point an unfinished request's row at the cache's pages before freeing its duplicates",
        ),
    ),
}

# the zoo runs on a copy with the known bug fixed, so each entry's own finding shows, not PR #142's
ZOO_ON_FIXES = ("pr142",)

ZOO: Tuple[SourceEdit, ...] = (
    SourceEdit(
        "minisgl-cache-req-keeps-old-lock",
        f"{_CACHE}.cache_req",
        "self.unlock(old_handle)",
        "if finished:  # BUG: an unfinished request keeps its old lock besides the new one\n"
        "        self.unlock(old_handle)",
        "lock leak: the handle is swapped without releasing the old one, so prefixes stay protected",
    ),
    SourceEdit(
        "minisgl-cache-req-tail-unlocked",
        f"{_CACHE}.cache_req",
        "self.lock(new_handle)",
        "pass  # BUG: the new handle is not locked",
        "a running request's prefix is evictable, and its release unlocks a lock it never took",
    ),
    SourceEdit(
        "minisgl-allocate-evicted-token-locations",
        f"{_CACHE}._allocate",
        "evicted[:: self.page_size]",
        "evicted",
        "every token location of an evicted page goes on the free list: each page freed page_size times",
    ),
    SourceEdit(
        "minisgl-allocate-paged-floor",
        f"{_CACHE}.allocate_paged",
        "first_page = div_ceil(req.cached_len, self.page_size)",
        "first_page = req.cached_len // self.page_size  # BUG: floor, not ceil",
        "a request's partly filled last page is allocated again: the old page leaks",
    ),
    SourceEdit(
        "minisgl-lazy-free-stays-lazy",
        f"{_CACHE}.lazy_free_region",
        "del self._free",
        "pass  # BUG: the lazy free stays installed",
        "after the first region every free goes to a list nobody drains: pages leak",
    ),
    SourceEdit(
        "minisgl-radix-insert-aliases-row",
        f"{_RADIX}.insert_prefix",
        "indices[prefix_len:].clone()",
        "indices[prefix_len:]",
        "a cached node's locations change when its table row is reused by another request",
    ),
    SourceEdit(
        "minisgl-radix-evict-keeps-size",
        f"{_RADIX}.evict",
        "self.evictable_size -= node.length",
        "pass  # BUG: the evictable size is not reduced",
        "the evictable counter overstates what can be evicted: admission counts pages that do not exist",
    ),
    SourceEdit(
        "minisgl-radix-unlock-leaf-only",
        f"{_RADIX}.lock_handle",
        "self.protected_size -= node.length\n            node = node.parent",
        "self.protected_size -= node.length\n            break  # BUG: only the handle's own node",
        "unlock releases the last node of the path only: its ancestors stay locked forever",
    ),
    SourceEdit(
        "minisgl-radix-match-partial-page",
        f"{_RADIX}._tree_walk",
        "match_len = align_down(match_len, self.page_size)",
        "pass  # BUG: a match is not rounded down to whole pages",
        "a hit ends inside a page: two requests then write the same page",
    ),
    SourceEdit(
        "minisgl-adder-no-batch-reservation",
        f"{_ADDER}._add_one_req",
        "self.reserved_size += remain_len + pending_req.output_len",
        "pass  # BUG: the batch's own admissions are not reserved",
        "requests admitted in one batch each fit alone, not together: a later allocation fails",
    ),
)
