"""kvledger's own cache managers as subjects: `kvledger.fast` (tensors) and `kvledger.reference` (the
pure-Python model), through the adapter for mini-sglang's `CacheManager` API (`minisgl_api.py`),
which they share, built the way `engine/ledger/cache_scheduler.py` builds them, under `reserve`
admission.

Two subjects from one module (`NAMES`): where another adapter takes a checkout path, `probe` and
`build` take the name (`NAME` when None), as the registry calls them.
Their zoo is `kvledger.subjects.fast_zoo` (patches of `fast` classes, run by `kvledger zoo`), not `ZOO`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType
from typing import Any, List, Sequence, Tuple

from kvledger.properties.subject import Capabilities, SubjectConfig, SubjectUnavailable
from kvledger.reference.admission_policy import RESERVE
from kvledger.reference.pages import div_ceil
from kvledger.subjects.edits import SourceEdit
from kvledger.subjects.minisgl_api import MinisglApiModules, MinisglApiSubject, radix_entries

NAME = "fast"
NAMES = ("fast", "reference")
ZOO: Tuple[SourceEdit, ...] = ()


def _version() -> str:
    try:
        return importlib.metadata.version("kvledger")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _tolist(x: Any) -> List[int]:
    return x.tolist() if hasattr(x, "tolist") else list(x)


def probe(name: str | None = None) -> Tuple[bool, str, str]:
    name = name or NAME
    if name not in NAMES:
        return False, "", f"no kvledger implementation {name!r}: one of {', '.join(NAMES)}"
    return True, _version(), f"kvledger.{name}"


def _modules(impl: ModuleType) -> MinisglApiModules:
    def managers(config: SubjectConfig):
        ps = config.page_size
        # CacheScheduler.__init__: rows of whole pages, no dummy row, no reserved page
        page_table = impl.make_page_table(config.max_running_req, div_ceil(config.max_seq_len, ps) * ps)
        cm = impl.CacheManager(config.num_pages, ps, page_table, "radix")
        return cm, impl.TableManager(config.max_running_req, page_table), impl.DecodeManager(ps, policy=RESERVE)

    def adder(budget: int, reserved: int, cm: Any, tm: Any) -> Any:
        return impl.PrefillAdder(budget, reserved, cm, tm, policy=RESERVE)

    def pending(uid: int, prompt: Sequence[int], max_tokens: int) -> Any:
        return impl.PendingReq(uid, list(prompt), impl.SamplingParams(max_tokens=max_tokens))

    def cached(cache: Any) -> List:
        return radix_entries(
            cache.root,
            lambda n: list(n.children.values()),
            lambda n: list(n.key),
            lambda n: _tolist(n.value),
            lambda n: n.ref_count,
            lambda n: f"node {n.id}",
        )

    return MinisglApiModules(
        PrefillAdder=adder,
        ChunkedReq=impl.ChunkedReq,
        managers=managers,
        pending=pending,
        token=int,
        tolist=_tolist,
        cached=cached,
    )


def build(config: SubjectConfig, name: str | None = None, edits: Sequence[SourceEdit] = ()) -> MinisglApiSubject:
    name = name or NAME
    if name not in NAMES:
        raise SubjectUnavailable(f"no kvledger implementation {name!r}: one of {', '.join(NAMES)}")
    impl = importlib.import_module(f"kvledger.{name}")
    caps = Capabilities(
        page_size=config.page_size,
        pages=tuple(range(config.num_pages)),
        worst_case_admission=True,  # the reserve policy: pages to max_device_len
        preempts=False,
        explicit_evict=True,
        cached_pages_in_free_pool=False,
        lockstep=True,
    )
    return MinisglApiSubject(name, _version(), caps, _modules(impl), config, edits)
