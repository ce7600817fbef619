"""The scopes of `kvledger explore`: the finite configurations whose every reachable state it visits.

A scope is a pool (pages, page size, table slots, cache kind, admission policy) and a finite
alphabet of operations over it: prompts (with shared and page-aligned prefixes), max_tokens
values, prefill budgets, the tokens a step samples, evict sizes, and which operation kinds are
enabled (submit, prefill, decode, finish, abort, evict, probe, idle). `max_live` bounds the
requests in the system at once (waiting or admitted); with it every scope is finite once states
are canonicalized (`explore_state.py`), since nothing else grows without bound. `max_depth`
and `max_states` cut a search that would take too long; a search that ends before either cut
has *exhausted* the scope.

`SCOPES` holds the named scopes (`--scope ci|small|large`, and the bug-hunting ones the zoo
table uses); `BUG_SCOPES` names, for each of the zoo's 39 bugs, the scope and depth bound in
which exploration finds it (tests/checker/test_explore_zoo.py runs them all).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Dict, FrozenSet, Optional, Tuple

from kvledger.engine.ledger.trace import Header

OP_KINDS = ("submit", "prefill", "decode", "finish", "abort", "evict", "probe", "idle")
DEFAULT_OPS: FrozenSet[str] = frozenset({"submit", "prefill", "decode", "finish", "abort", "evict"})
Prompt = Tuple[int, ...]


@dataclass(frozen=True)
class Scope:
    """One finite configuration: the pool, the operation alphabet, and the search's cuts."""

    name: str
    num_pages: int
    page_size: int
    table_slots: int
    cache_type: str = "radix"
    admission: str = "reserve"
    reserve_ratio: float = 0.5
    prompts: Tuple[Prompt, ...] = ((0,), (0, 1))
    max_tokens: Tuple[int, ...] = (1, 2)
    budgets: Tuple[int, ...] = (1, 8)
    samples: Tuple[Tuple[int, ...], ...] = ((),)  # () samples token 0, as a trace's empty list does
    evicts: Tuple[int, ...] = (1,)  # evict sizes in tokens (clipped to what is evictable)
    evict_all: bool = True  # also evict everything evictable
    probes: Tuple[Prompt, ...] = ()  # with "probe" enabled: the prompts probed ((): the prompt alphabet)
    ops: FrozenSet[str] = field(default=DEFAULT_OPS)
    max_live: int = 2  # requests in the system at once (waiting or admitted)
    max_depth: Optional[int] = None  # operations along a path (None: no cut)
    max_states: Optional[int] = None  # distinct states stored (None: no cut)
    spec_tokens: int = 0  # > 0: both sides speculate (the header's spec_tokens); each decode tries each of `accepts`
    accepts: Tuple[Tuple[int, ...], ...] = ((),)

    def __post_init__(self) -> None:
        unknown = set(self.ops) - set(OP_KINDS)
        if unknown:
            raise ValueError(f"scope {self.name}: unknown operations {sorted(unknown)}; known: {', '.join(OP_KINDS)}")
        if not self.prompts or any(not p for p in self.prompts):
            raise ValueError(f"scope {self.name}: prompts must be non-empty token lists")
        if min(self.num_pages, self.page_size, self.table_slots, self.max_live) < 1:
            raise ValueError(f"scope {self.name}: pages, page size, table slots and max_live must be >= 1")
        if not self.max_tokens or min(self.max_tokens) < 1 or not self.budgets or min(self.budgets) < 1:
            raise ValueError(f"scope {self.name}: max_tokens and budgets must be non-empty and >= 1")
        self.header().validate()

    @property
    def max_seq_len(self) -> int:
        """Room for the longest prompt and the largest max_tokens, in whole pages."""
        need = max(map(len, self.prompts)) + max(self.max_tokens)
        return -(-need // self.page_size) * self.page_size

    def never_admits(self) -> Optional[str]:
        """Why no request of this scope can ever be admitted, or None. A lower bound on what the
        smallest request needs: its prompt's pages (and, under reserve admission, the KV of every
        token it may generate but the last), against the whole pool."""
        reserve = self.admission == "reserve"
        need, prompt, most = min(
            (-(-(len(p) + (m - 1 if reserve else 0)) // self.page_size), p, m)
            for p in self.prompts
            for m in self.max_tokens
        )
        if need <= self.num_pages:
            return None
        what = f"prompt {list(prompt)} with max_tokens {most}" if reserve else f"prompt {list(prompt)}"
        return (
            f"no request can ever be admitted: the smallest, {what}, needs {need} pages under "
            f"{self.admission} admission and the pool has {self.num_pages}"
        )

    @property
    def probe_prompts(self) -> Tuple[Prompt, ...]:
        return self.probes or self.prompts

    def header(self, producer: str = "kvledger explore") -> Header:
        """The trace header a counterexample of this scope is written with."""
        return Header(
            num_pages=self.num_pages,
            page_size=self.page_size,
            cache_type=self.cache_type,
            table_slots=self.table_slots,
            max_seq_len=self.max_seq_len,
            admission=self.admission,
            reserve_ratio=self.reserve_ratio,
            seed=None,
            producer=producer,
            spec_tokens=self.spec_tokens,
        )

    def with_(self, **changes) -> Scope:
        return replace(self, **changes)

    def describe(self) -> str:
        """One line per parameter, as `kvledger explore` prints the scope."""
        d = asdict(self)
        d["ops"] = ",".join(k for k in OP_KINDS if k in self.ops)
        d["max_seq_len"] = self.max_seq_len
        order = [
            "name",
            "num_pages",
            "page_size",
            "table_slots",
            "cache_type",
            "admission",
            "reserve_ratio",
            "max_seq_len",
            "prompts",
            "max_tokens",
            "budgets",
            "samples",
            "evicts",
            "evict_all",
            "probes",
            "ops",
            "max_live",
            "max_depth",
            "max_states",
        ] + (["spec_tokens", "accepts"] if self.spec_tokens else [])
        return "\n".join(f"  {k:<14} {_show(d[k])}" for k in order)


def _show(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return " ".join(
            _show(v) if not isinstance(v, (tuple, list)) else "[" + ",".join(map(str, v)) + "]" for v in value
        )
    return str(value)


_ALL = frozenset(OP_KINDS)

SCOPES: Dict[str, Scope] = {
    s.name: s
    for s in (
        # small: exhausted in seconds; the canonical-vs-plain test's scope is smaller still
        Scope("small", num_pages=2, page_size=1, table_slots=2, prompts=((0,), (0, 0)), max_tokens=(1, 2)),
        # CI: exhausted in under two minutes on 2 cores (docs/exploration.md has the numbers)
        Scope("ci", num_pages=3, page_size=1, table_slots=2, prompts=((0,), (0, 0)), max_tokens=(1, 2)),
        # large: a third prompt diverging from the others at its first token
        Scope("large", num_pages=3, page_size=1, table_slots=2, prompts=((0,), (0, 0), (1, 0)), max_tokens=(1, 2)),
        # bug hunting: each a few seconds to the depth its bugs need (BUG_SCOPES)
        Scope(
            "bug-radix",
            num_pages=3,
            page_size=1,
            table_slots=2,
            prompts=((0,), (0, 0), (1, 0), (0, 0, 0, 0)),
            max_tokens=(1, 2),
            budgets=(1, 2, 8),
            ops=_ALL,
            max_live=2,
        ),
        Scope(
            "bug-paged",
            num_pages=3,
            page_size=2,
            table_slots=2,
            prompts=((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)),
            max_tokens=(1, 2),
            budgets=(1, 2, 8),
            ops=_ALL,
            max_live=2,
        ),
        Scope(
            "bug-naive",
            num_pages=4,
            page_size=2,
            table_slots=2,
            cache_type="naive",
            prompts=((0,), (0, 0, 0)),
            max_tokens=(1, 4),
            budgets=(1, 8),
            max_live=2,
        ),
        Scope(
            "bug-optimistic",
            num_pages=3,
            page_size=1,
            table_slots=2,
            admission="optimistic",
            reserve_ratio=0.0,
            prompts=((0,), (1,), (1, 0)),
            max_tokens=(1, 3),
            budgets=(1, 8),
            ops=_ALL - {"probe", "idle"},
            max_live=2,
        ),
        Scope(
            "bug-optimistic-naive",
            num_pages=3,
            page_size=2,
            table_slots=1,
            cache_type="naive",
            admission="optimistic",
            reserve_ratio=0.25,
            prompts=((0, 0, 0),),
            max_tokens=(4,),
            budgets=(8,),
            max_live=1,
        ),
        # evict-counts-pages: two one-page leaves cached, then a prompt that needs both evicted
        Scope(
            "bug-evict-paged",
            num_pages=3,
            page_size=2,
            table_slots=1,
            prompts=((0, 0, 0), (1, 1, 1), (2, 2, 2, 2, 2)),
            max_tokens=(1,),
            budgets=(8,),
            ops=frozenset({"submit", "prefill"}),
            max_live=1,
        ),
        # preempt-frees-to-free-list: an older cached leaf, then two requests that outgrow the pool
        Scope(
            "bug-optimistic-wide",
            num_pages=4,
            page_size=1,
            table_slots=2,
            admission="optimistic",
            reserve_ratio=0.0,
            prompts=((1,), (0,)),
            max_tokens=(1, 3),
            budgets=(8,),
            ops=frozenset({"submit", "prefill", "decode"}),
            max_live=2,
        ),
        # fast's speculation (the spec- bugs): one request whose decodes verify 2 drafts, none or all accepted
        Scope(
            "bug-spec",
            num_pages=4,
            page_size=2,
            table_slots=1,
            prompts=((0,), (0, 1, 0)),
            max_tokens=(5,),
            budgets=(8,),
            samples=((), (0, 1)),
            ops=frozenset({"submit", "prefill", "decode"}),
            max_live=1,
            spec_tokens=2,
            accepts=((), (2,)),
        ),
        # requeue-victims-reversed: three live requests, and a decode that preempts the two newest
        Scope(
            "bug-optimistic-three",
            num_pages=3,
            page_size=1,
            table_slots=3,
            admission="optimistic",
            reserve_ratio=0.0,
            prompts=((0,), (1,)),
            max_tokens=(2,),
            budgets=(8,),
            ops=frozenset({"submit", "prefill", "decode"}),
            max_live=3,
        ),
    )
}


@dataclass(frozen=True)
class BugScope:
    """Where exploration finds one zoo bug: a named scope (plus changes), and the depth bound."""

    scope: str
    max_depth: int  # the shortest counterexample's length: the search is cut there
    kind: str  # the divergence kind the shortest counterexample ends in

    def build(self) -> Scope:
        return SCOPES[self.scope].with_(max_depth=self.max_depth)


# From the sweep in results/explore/zoo-sweep.json (docs/bug-zoo.md's table); every entry is
# exercised by tests/checker/test_explore_zoo.py, which expects exactly this length and kind.
BUG_SCOPES: Dict[str, BugScope] = {
    "no-remap-on-duplicate": BugScope("bug-radix", 3, "invariant:1-2-partition"),
    "double-free-on-finish": BugScope("bug-radix", 2, "invariant:1-2-partition"),
    "frees-locked-prefix": BugScope("bug-radix", 3, "invariant:1-2-partition"),
    "unlock-wrong-handle": BugScope("bug-paged", 2, "fast-raised:RuntimeError"),
    "lazy-free-holds-views": BugScope("bug-radix", 3, "invariant:1-2-partition"),
    "evict-counts-pages": BugScope("bug-evict-paged", 6, "invariant:3-no-oom"),
    "free-list-lifo": BugScope("bug-radix", 2, "state:free_slots"),
    "allocate-floor-pages": BugScope("bug-paged", 2, "invariant:1-2-partition"),
    "match-whole-prompt": BugScope("bug-radix", 3, "result:probe"),
    "available-ignores-evictable": BugScope("bug-radix", 2, "state:available_size"),
    "reservation-in-tokens": BugScope("bug-naive", 3, "result:prefill"),
    "inflight-in-tokens": BugScope("bug-paged", 2, "state:inflight_tokens"),
    "no-recheck-after-lock": BugScope("bug-radix", 4, "result:prefill"),
    "budget-charges-cached-prefix": BugScope("bug-radix", 4, "result:prefill"),
    "table-slot-leak": BugScope("bug-radix", 2, "state:table_free"),
    "lock-skips-own-node": BugScope("bug-radix", 2, "invariant:1-2-partition"),
    "unlock-skips-evictable-size": BugScope("bug-radix", 3, "invariant:1-2-partition"),
    "lock-keeps-heap-entry": BugScope("bug-paged", 2, "invariant:1-2-partition"),
    "match-returns-root": BugScope("bug-radix", 3, "result:probe"),
    "insert-stores-view": BugScope("bug-radix", 5, "invariant:1-2-partition"),
    "insert-unaligned": BugScope("bug-paged", 2, "invariant:1-2-partition"),
    "split-unaligned": BugScope("bug-paged", 3, "result:probe"),
    "split-drops-ref-count": BugScope("bug-radix", 3, "result:probe"),
    "lru-not-touched-on-match": BugScope("bug-radix", 5, "result:evict"),
    "lru-evicts-mru": BugScope("bug-radix", 4, "result:evict"),
    "touch-keeps-heap-entry": BugScope("bug-optimistic", 6, "result:evict"),
    "insert-keeps-parent-heap-entry": BugScope("bug-radix", 3, "invariant:1-2-partition"),
    "preempt-frees-to-free-list": BugScope("bug-optimistic-wide", 5, "state:free_slots"),
    "preempt-keeps-prefix-lock": BugScope("bug-optimistic", 4, "invariant:1-2-partition"),
    "preempt-frees-whole-row": BugScope("bug-optimistic", 4, "invariant:1-2-partition"),
    "preempt-double-free": BugScope("bug-optimistic", 5, "invariant:1-2-partition"),
    "resume-from-prompt": BugScope("bug-optimistic", 4, "state:waiting"),
    "resume-keeps-max-tokens": BugScope("bug-optimistic", 4, "invariant:3-no-oom"),
    "resume-drops-inflight-token": BugScope("bug-optimistic", 4, "state:waiting"),
    "preempt-oldest-first": BugScope("bug-optimistic", 4, "invariant:6-preemption-order"),
    "victim-still-counted": BugScope("bug-optimistic", 5, "invariant:3-no-oom"),
    "optimistic-ratio-of-whole-length": BugScope("bug-optimistic-naive", 2, "state:inflight_tokens"),
    "optimistic-no-next-token": BugScope("bug-optimistic", 2, "state:inflight_tokens"),
    "needed-size-in-tokens": BugScope("bug-optimistic-naive", 5, "invariant:3-no-oom"),
    # a bug of the scheduler both sides share: the reference side is judged first
    "requeue-victims-reversed": BugScope("bug-optimistic-three", 5, "reference-invariant:10-queue-order"),
    # fast's speculation: a speculating scope (its header sets spec_tokens)
    "spec-draft-room-no-bonus": BugScope("bug-spec", 4, "fast-raised:RuntimeError"),
    "spec-propose-no-lookahead": BugScope("bug-spec", 3, "invariant:8-request"),
    "spec-verify-commits-rejected": BugScope("bug-spec", 3, "invariant:8-request"),
    "spec-verify-bonus-first": BugScope("bug-spec", 3, "invariant:7-kv-provenance"),
    "spec-release-rounds-commit-down": BugScope("bug-spec", 4, "invariant:1-2-partition"),
    "spec-release-rounds-reserve-down": BugScope("bug-spec", 4, "invariant:11-spec"),
}


def scope_for_bug(bug: str) -> Scope:
    if bug not in BUG_SCOPES:
        raise KeyError(f"no exploration scope recorded for bug {bug!r}")
    return BUG_SCOPES[bug].build()
