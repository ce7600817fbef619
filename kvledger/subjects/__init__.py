"""The subjects kvledger checks, and how a spec names one.

A spec is one of:
  fast, reference            kvledger's own cache managers (judge mode, and lockstep against reference)
  vllm, sglang               the installed vLLM 0.33 / SGLang 0.5.23 (`make subjects` installs them)
  vllm:sched, vllm:spec,     vLLM's real Scheduler driving its cache manager (it schedules itself:
  vllm:async                 `properties/scheduling_subject.py`): plain, speculative decoding,
                             async scheduling (`vllm_scheduler.py`)
  vllm:hybrid, vllm:external the same with a full-attention + sliding-window pair of KV groups
                             (`vllm_hybrid.py`), with a KV connector loading outside KV (`vllm_external.py`)
  vllm:local                 the same with full attention + chunked local attention (`vllm_local.py`)
  sglang:radix               SGLang's classic RadixCache in place of the default UnifiedRadixCache (`sglang.py`)
  sglang:paged               page size > 1 with SGLang's decode memory check and retract_decode (`sglang_paged.py`)
  sglang:swa                 the default tree with its sliding-window option: FULL and SWA pools (`sglang_swa.py`)
  sglang:spec                SGLang's speculative decoding allocation, NGRAM at page size 4 (`sglang_spec.py`)
  sglang:overlap             sglang:spec under SGLang's overlap event loop, with retract (`sglang_overlap.py`)
  sglang:hicache             sglang:paged with SGLang's host-memory tier behind the device pool (`sglang_hicache.py`)
  minisgl[:PATH]             a mini-sglang checkout or snapshot (default: the shipped peer)
  nanovllm[:PATH]            a nano-vllm checkout or snapshot (nanovllm@f64d821 names a shipped commit)
  package.module:factory     a user's own: `factory(SubjectConfig) -> Subject`

Each adapter is the module BUILTINS names; it exports NAME, probe(path), build(config, path, edits)
and ZOO (see `docs/checking-your-cache-manager.md`). A large one keeps its parts in modules beside
it (`sglang.py` with `sglang_import.py`, `sglang_scheduler.py`, `sglang_zoo.py`). A module that
serves several named specs (`vllm_scheduler.py`: vllm:sched, vllm:spec, vllm:async) exports
build_spec(config, name, edits) and ZOOS (name -> its zoo) instead of build and ZOO.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Dict, List, Sequence, Tuple

from kvledger.properties.subject import Subject, SubjectConfig, SubjectUnavailable
from kvledger.subjects.edits import SourceEdit

BUILTINS: Dict[str, str] = {
    "fast": "kvledger.subjects.kvledger_own",
    "reference": "kvledger.subjects.kvledger_own",
    "minisgl": "kvledger.subjects.minisgl",
    "nanovllm": "kvledger.subjects.nanovllm",
    "vllm": "kvledger.subjects.vllm",
    "vllm:sched": "kvledger.subjects.vllm_scheduler",
    "vllm:spec": "kvledger.subjects.vllm_scheduler",
    "vllm:async": "kvledger.subjects.vllm_scheduler",
    "vllm:hybrid": "kvledger.subjects.vllm_hybrid",
    "vllm:local": "kvledger.subjects.vllm_local",
    "vllm:external": "kvledger.subjects.vllm_external",
    "sglang": "kvledger.subjects.sglang",
    "sglang:radix": "kvledger.subjects.sglang",
    "sglang:paged": "kvledger.subjects.sglang_paged",
    "sglang:swa": "kvledger.subjects.sglang_swa",
    "sglang:spec": "kvledger.subjects.sglang_spec",
    "sglang:overlap": "kvledger.subjects.sglang_overlap",
    "sglang:hicache": "kvledger.subjects.sglang_hicache",
}


class SpecError(ValueError):
    pass


@dataclass(frozen=True)
class SubjectSpec:
    text: str
    name: str  # a builtin's name, or the user's module:factory
    path: str | None = None  # a checkout (minisgl, nanovllm); "@commit" names a shipped snapshot

    @property
    def builtin(self) -> bool:
        return self.name in BUILTINS

    def adapter(self) -> ModuleType:
        if not self.builtin:
            raise SpecError(f"{self.text}: not a builtin subject")
        return importlib.import_module(BUILTINS[self.name])

    def factory(self, edits: Sequence[SourceEdit] = ()) -> Callable[[SubjectConfig], Subject]:
        """config -> a fresh subject instance (with `edits` bound into it)."""
        if self.builtin:
            module = self.adapter()
            return lambda config: _build(module, config, self, edits)
        module_name, _, attr = self.name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise SubjectUnavailable(f"{self.text}: cannot import {module_name}: {e}") from None
        factory = getattr(module, attr, None)
        if not callable(factory):
            raise SpecError(f"{self.text}: {module_name} has no callable {attr!r}")
        if edits:
            raise SpecError(f"{self.text}: edits apply to builtin subjects only")
        return factory

    def page_sizes(self, wanted: Sequence[int] = (1, 2, 4)) -> Tuple[int, ...]:
        """The page sizes of `wanted` this subject runs with (an adapter's MIN_PAGE_SIZE)."""
        least = getattr(self.adapter(), "MIN_PAGE_SIZE", 1) if self.builtin else 1
        return tuple(ps for ps in wanted if ps >= least) or (least,)

    def zoo(self) -> Tuple[SourceEdit, ...]:
        if not self.builtin:
            return ()
        module = self.adapter()
        if hasattr(module, "ZOOS"):
            return tuple(module.ZOOS.get(self.name, ()))
        return tuple(getattr(module, "ZOO", ()))

    def fixes(self) -> Dict[str, Tuple[SourceEdit, ...]]:
        return dict(getattr(self.adapter(), "FIXES", {})) if self.builtin else {}

    def zoo_base(self) -> Tuple[SourceEdit, ...]:
        """The fixes every zoo entry runs on top of (a known bug that would mask the entry's own)."""
        fixes = self.fixes()
        return (
            tuple(e for name in getattr(self.adapter(), "ZOO_ON_FIXES", ()) for e in fixes[name])
            if self.builtin
            else ()
        )


def _build(module: ModuleType, config: SubjectConfig, spec: SubjectSpec, edits: Sequence[SourceEdit]) -> Subject:
    if spec.name in ("fast", "reference"):
        return module.build(config, spec.name, edits)
    if hasattr(module, "build_spec"):
        return module.build_spec(config, spec.name, edits)
    return module.build(config, spec.path, edits)


def parse_spec(text: str) -> SubjectSpec:
    """`name`, `name:PATH`, `name@commit` (a shipped snapshot) or `package.module:factory`."""
    text = text.strip()
    if not text:
        raise SpecError("empty subject spec (try `kvledger subjects`)")
    if ":" in text and text in BUILTINS:  # a named builtin: vllm:sched, vllm:spec, ...
        return SubjectSpec(text, text)
    head, sep, rest = text.partition(":")
    name, at, commit = head.partition("@")
    if name in BUILTINS:
        if name in ("fast", "reference", "vllm", "sglang") and (sep or at):
            raise SpecError(f"{text}: {name} takes no path")
        path = rest or None
        if at:
            from kvledger.subjects.peers import peer_path

            found = peer_path({"minisgl": "mini-sglang", "nanovllm": "nano-vllm"}[name], commit)
            if found is None:
                raise SubjectUnavailable(f"{text}: no shipped snapshot of commit {commit} (set KVLEDGER_PEERS)")
            path = str(found)
        return SubjectSpec(text, name, path)
    if sep and rest.isidentifier() and all(p.isidentifier() for p in head.split(".")):
        return SubjectSpec(text, text)
    raise SpecError(
        f"unknown subject {text!r}: builtins are {', '.join(BUILTINS)}; a path goes after a colon "
        "(minisgl:PATH), a user's subject is package.module:factory"
    )


def probe_all() -> List[Tuple[str, bool, str, str]]:
    """(name, installed, version, detail) of every builtin, without importing heavy packages."""
    rows = []
    for name in BUILTINS:
        try:
            module = importlib.import_module(BUILTINS[name])
            installed, version, detail = module.probe(name if name in ("fast", "reference") else None)
        except Exception as e:  # an adapter that cannot even probe: say so, keep listing
            installed, version, detail = False, "-", f"{type(e).__name__}: {e}"
        rows.append((name, installed, version, detail))
    return rows
