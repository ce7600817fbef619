"""The subject protocol: how kvledger drives a cache manager it did not write.

A *subject* is any KV-cache manager put under kvledger: vLLM's `KVCacheManager`, SGLang's radix
cache with its paged allocator, mini-sglang's `CacheManager`, nano-vllm's `BlockManager`,
kvledger's own `fast` and `reference`, or a user's. kvledger's driver plays the serving
scheduler (it owns the waiting queue, the token budget, sampling and stop decisions) and talks to
the subject through the calls below, in engine terms; the adapter turns each call into the calls
the subject's own scheduler makes, in the same order, so any finding is a sequence the real
system can reach.

The calls, in the order a request sees them:

  submit(uid, prompt, max_tokens)    the request exists (queued by the driver)
  admit(uid, budget) -> hit | None   prefix match plus whatever the subject reserves or allocates
                                     at admission for a first chunk of up to `budget` tokens; the
                                     number of prompt tokens found cached, or None: refused, and
                                     nothing changed
  allocate(uid, start, end) -> bool  give positions [start, end) locations (a prefill chunk, a
                                     decode token); False: no room, nothing changed. A range the
                                     subject already allocated (at admission) is a no-op
  computed(uid, start, end, token)   a forward pass wrote KV for positions [start, end); `token`
                                     is the token sampled after it (None mid-prefill). The
                                     subject may publish hashes or hand KV to its prefix cache
  finish(uid)                        the request ended (max_tokens or a stop token)
  abort(uid)                         dropped, waiting (admitted mid-prefill or not) or running
  preempt(uid)                       (capability `preempts`) release a live request's pages; it
                                     is admitted again later from its prompt plus its output
  evict(tokens) -> int               (capability `explicit_evict`) evict from the prefix cache
  victim(uid) -> int                 (capability `chooses_victim`) an allocation for `uid` found no
                                     room: the live request the subject gives up (it may be `uid`);
                                     the driver then calls preempt on it
  view() -> View                     the subject's raw state, read from its own structures

A subject may also reach rare states of its own (SGLang's overlap loop, its host tier): it
declares their names in `rare_events` and appends each as it reaches it to a list `reached`,
which the driver empties after every operation (reported as `kvledger check` and fuzz report
the judge's own rare states).

A subject that schedules itself (vLLM's real `Scheduler`: capability `schedules`) is driven one
step at a time instead, through `properties/scheduling_subject.py`; its View is the same.

Errors: an exception raised by the subject inside any call is a finding (`subject-raised:X`),
reported with its traceback by the driver; an adapter raises `SubjectUnavailable` only from its
factory, when the subject cannot be imported.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

from kvledger.engine.ledger.trace import Header


class SubjectUnavailable(RuntimeError):
    """The subject cannot be built here: the message names what is missing and how to install it."""


class DriverMismatch(RuntimeError):
    """An adapter was asked for something its subject's own scheduler would never do at this point
    (a range it would not schedule, a call out of order): a protocol error between the driver and
    the adapter, not a bug of the subject. The driver reports it as `subject-raised:DriverMismatch`."""


@dataclass(frozen=True)
class SubjectConfig:
    """The pool a subject is built with: every subject gets the same shape for one trace."""

    num_pages: int  # usable pages (a subject that reserves a page, as vLLM and SGLang do, adds it)
    page_size: int
    max_seq_len: int  # prompt + max_tokens of any request
    # concurrent live requests (request-table rows): mini-sglang's name for it; a trace's header says table_slots
    max_running_req: int = 8

    @property
    def max_running(self) -> int:
        """The former name of `max_running_req` (deprecated)."""
        warnings.warn("SubjectConfig.max_running is deprecated: use max_running_req", FutureWarning, stacklevel=2)
        return self.max_running_req


@dataclass(frozen=True)
class Capabilities:
    """What a subject does, which decides what the driver asks and what the judge expects."""

    page_size: int
    pages: Tuple[int, ...]  # the page ids it hands out (location = page * page_size + offset)
    worst_case_admission: bool  # an admitted request never fails an allocation later
    preempts: bool  # a step that finds no room preempts the newest live request (vLLM, nano-vllm)
    explicit_evict: bool  # evict(tokens) is part of its API
    cached_pages_in_free_pool: bool  # a cached page nobody uses sits in the free queue (vLLM, nano-vllm)
    chunked_prefill: bool = True  # may admit part of a prompt; the rest in later steps
    chunk_only_first: bool = False  # only the first request of a prefill batch may be chunked (nano-vllm)
    prefill_publishes_to_cache: bool = True  # a request's computed full pages can be hit while it runs
    lockstep: bool = False  # implements the seed's policy deterministically: comparable with `reference`
    # -- what real managers do beyond the plain path (each judged by clauses of its own) --------------
    schedules: bool = False  # a SchedulingSubject: its own scheduler decides each step (scheduling_subject.py)
    in_flight: int = 1  # steps scheduled before the oldest one's outputs arrive (vLLM async scheduling: 2)
    spec_tokens: int = 0  # draft tokens verified per decode step (speculative decoding); 0: none
    # positions a live request may hold locations for past the tokens it has (lookahead slots,
    # drafts, an overlap reserve): over-allocation, owned and not yet written
    max_ahead: int = 0
    external_kv: bool = False  # loads KV computed elsewhere (a KV connector, a host tier)
    # the order requests waiting again (preempted) resume in: "admission" (the one admitted first
    # resumes first: kvledger's own scheduler, vLLM's FCFS), or "any" (the subject's own, not judged)
    resume_order: str = "admission"
    evicts_before_admit: bool = False  # admission may evict cached prefixes, and keeps that when it refuses
    preempt_keeps_pages: bool = False  # a preempted request keeps its pages until resumed or dropped
    chooses_victim: bool = False  # the subject names the request to preempt (`victim`), not the newest
    cache_holds_reference: bool = False  # the prefix cache holds its own reference on each cached page
    # admission keeps a margin of the pool (SGLang: a page plus the request's decode tokens), so a
    # request admitted on a prefix hit may never fit an idle pool on its own pages
    admission_margin: bool = False
    # KV groups with a pool of their own (SGLang's SWA allocator keeps the window's KV apart from
    # the full-attention KV): group_pools[n - 1] the pages of group n's pool, disjoint from `pages`
    # and from each other; a group past its end, or with an empty tuple, draws from `pages`
    group_pools: Tuple[Tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class CachedEntry:
    """One entry of the subject's prefix cache, as its structure holds it.

    `locations[i]` holds the KV of position `start + i`. A radix tree knows its path, so it gives
    `tokens`: the whole prefix [0, start + len(locations)) the entry claims. A hash-chained block
    cache stores a key instead: `key` (the judge recomputes it from the tokens the KV was written
    for, with the subject's own `cache_key`), and `start` may be None (the position comes from
    what was written there). `lock` is the entry's lock or reference count where the subject
    keeps one per entry (radix nodes); None where counts are per page (`View.page_refs`)."""

    locations: Tuple[int, ...]
    start: int | None = 0
    tokens: Tuple[int, ...] | None = None
    key: Hashable | None = None
    lock: int | None = None
    name: str = ""  # how the subject names it (a node id, a block id), for messages
    group: int = 0  # the KV group it belongs to (0: `View.requests`; n: `View.groups[n - 1]`)


@dataclass
class GroupView:
    """A KV group past the first (several groups per request: full attention plus a sliding
    window, vLLM's hybrid coordinator, SGLang's SWA pool). One pool serves every group (vLLM), or
    the group has a pool of its own (`Capabilities.group_pools`: SGLang's SWA allocator), whose
    free list is `free` and whose counters are `counters`; each request holds its own row per
    group. `window` W: position p attends to positions [p - W + 1, p], so the group may drop
    (free, or replace by a null block) any position before `computed - W + 1`; such a position is
    None in the row. `chunk` C instead (chunked local attention, vLLM's ChunkedLocalAttentionSpec):
    position p attends to [p // C * C, p], its own chunk only. Neither: full attention."""

    name: str
    window: int | None
    requests: Dict[int, List[int | None]]  # live uid -> location of each position (None: dropped)
    free: List[int] | None = None  # its own pool's free pages, in its order (None: it draws from View.free)
    counters: Dict[str, int] = field(default_factory=dict)  # its own pool's counters (View.counters' names)
    chunk: int | None = None  # chunked local attention of chunks of `chunk` positions

    def first_read(self, position: int) -> int:
        """The first position that position `position` attends to in this group."""
        if self.chunk is not None:
            return position // self.chunk * self.chunk
        return 0 if self.window is None else max(0, position - self.window + 1)


@dataclass
class View:
    """The subject's raw state. Each field reads the subject's own structure, never a value
    recomputed from other fields: the judge checks the subject, not the adapter."""

    free: List[int]  # pages in its free list or queue, in its order, duplicates kept
    requests: Dict[int, List[int]]  # live (admitted) uid -> location of each position it holds
    cached: List[CachedEntry] = field(default_factory=list)
    page_refs: Dict[int, int] | None = None  # page -> its reference count, where the subject keeps one
    # counters the subject keeps about those structures, by meaning: "free_pages" (its count of
    # free pages), "evictable_tokens" / "protected_tokens" / "cached_tokens" (unlocked, locked and
    # all tokens of its prefix cache), "available_tokens" (what it says it can still hand out)
    counters: Dict[str, int] = field(default_factory=dict)
    waiting: List[int] | None = None  # its own waiting queue's uids, where it keeps one
    groups: List[GroupView] = field(default_factory=list)  # KV groups past the first (`GroupView`)
    # preempted uid -> locations it still holds (capability `preempt_keeps_pages`)
    preempted: Dict[int, List[int]] = field(default_factory=dict)


@runtime_checkable
class Subject(Protocol):
    name: str
    version: str
    capabilities: Capabilities

    def submit(self, uid: int, prompt: Sequence[int], max_tokens: int) -> None: ...
    def admit(self, uid: int, budget: int) -> int | None: ...
    def allocate(self, uid: int, start: int, end: int) -> bool: ...
    def computed(self, uid: int, start: int, end: int, token: int | None) -> None: ...
    def finish(self, uid: int) -> None: ...
    def abort(self, uid: int) -> None: ...
    def preempt(self, uid: int) -> None: ...
    def evict(self, tokens: int) -> int: ...
    def view(self) -> View: ...
    # the key a hash-chained cache files the prefix `tokens` under (whole pages), with the
    # subject's own hash function; radix subjects never need it. A subject with KV groups
    # (`View.groups`) takes the group too: `cache_key(tokens, group)`
    def cache_key(self, tokens: Sequence[int]) -> Hashable: ...

    # A subject that speculates (`spec_tokens` K > 0) also takes `drafted(uid, n, drafts)`: the
    # drafter's K tokens for positions [n, n + K), between `allocate` and `computed`; and, only if
    # it defines it, `rejected(uid, start, end)`: positions whose draft KV verification threw away
    # (the call order, and what the judge adds: `subject_speculation.py`).


SubjectFactory = Callable[[SubjectConfig], Subject]


def config_of(header: Header) -> SubjectConfig:
    """The pool a trace header describes, as a subject is built with it."""
    return SubjectConfig(
        num_pages=header.num_pages,
        page_size=header.page_size,
        max_seq_len=header.max_seq_len,
        max_running_req=header.table_slots,
    )


def header_of(config: SubjectConfig, seed: Optional[int], producer: str, subject: str, version: str) -> Header:
    """The trace header of a subject's run on `config` (a subject's traces are radix-typed)."""
    return Header(
        num_pages=config.num_pages,
        page_size=config.page_size,
        cache_type="radix",
        table_slots=config.max_running_req,
        max_seq_len=config.max_seq_len,
        seed=seed,
        producer=producer,
        subject=subject,
        subject_version=version,
    )
