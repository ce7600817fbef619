"""`kvledger minimize`: structure-aware delta debugging of a failing trace.

The fingerprint is the kind of the Finding the original trace raises ("state:owner",
"invariant:3-no-oom", ...). A candidate counts only if replaying it raises a Finding of the
same kind. Passes, repeated until none makes progress (or the time budget runs out):

  pool       fewer pages and table slots (binary search; a smaller pool often fails sooner)
  requests   remove whole requests (a submit and every op naming its uid), ddmin-style
  header     a smaller page size, fewer pages and table slots, a shorter max_seq_len
  ops        remove chunks of operations (halving), down to single operations
  merge      two prefills in a row become one with both budgets
  values     shorten token lists, lower max_tokens, budgets, samples, evict sizes
  renumber   uids densely in order of submission, token values 0, 1, 2, ... by first use

Every accepted candidate is strictly simpler (`_size`), outcomes are cached by the hash of the
serialized candidate, and the time budget is checked before every replay. A candidate is a list of
typed trace lines (`OpRecord`); a shrink is `dataclasses.replace` on an operation (`_set`).

Removing something often makes a later operation invalid (finish of a request that is gone,
an evict larger than what is evictable). Such a candidate is repaired rather than thrown away:
the replay skips operations the model rejects as invalid before changing anything, and the
operations that did apply become the candidate. Replays stop at the first divergence, so what
follows it is dropped too. A fixpoint of the single-operation pass is therefore 1-minimal: no
single operation can be removed, repaired or not.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import sys
import time
from dataclasses import replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union

from kvledger.checker import sandbox
from kvledger.checker.isolated_runs import Replayer, replay_isolated
from kvledger.engine.ledger import trace
from kvledger.engine.ledger.cache_scheduler import InvalidOp
from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import (
    Abort,
    CacheOp,
    Decode,
    Evict,
    Finish,
    OpRecord,
    Prefill,
    Probe,
    Submit,
    TraceLine,
    as_record,
)
from kvledger.engine.ledger.trace import Header, dumps
from kvledger.properties.isolation import IN_PROCESS
from kvledger.properties.subject import Subject, SubjectConfig
from kvledger.properties.target import (
    LockstepTarget,
    Run,
    SubjectTarget,
    Target,
    config_of,
    header_of,
)

_log = logging.getLogger(__name__)  # `log` is the minimizer's callback

Ops = List[OpRecord]
# ops that name a request: submit/finish/abort through "uid", prefill/decode through "stop"
_UID_OPS = (Submit, Finish, Abort)
PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64)


class MinimizeError(ValueError):
    """The input cannot be minimized (it does not fail, or it is invalid)."""


class _OutOfTime(Exception):
    pass


def fingerprint_of(header: Header, ops: Sequence[TraceLine], target: Optional[Target] = None) -> Tuple[str, int]:
    """Replay (strictly, on lockstep); return the Finding's (kind, step). Raises MinimizeError if
    the trace passes or is invalid."""
    kind, step, _ = _fingerprint(target or LockstepTarget(), header, ops)
    return kind, step


def _fingerprint(target: Target, header: Header, ops: Sequence[TraceLine]) -> Tuple[str, int, Ops]:
    """(kind, step, the operations applied up to the failing one)."""
    try:
        finding, applied = replay_isolated(target, header, ops)
    except InvalidOp as e:
        raise MinimizeError(f"the trace is invalid at operation {getattr(e, 'step', '?')}: {e}") from None
    if finding is None:
        raise MinimizeError(
            f"the trace does not fail: its {len(ops)} operations replay with no divergence "
            "(nothing to minimize; a bug-zoo trace needs its bug patched in, e.g. --bug NAME)"
        )
    return finding.kind, finding.step if finding.step is not None else 0, list(applied or [])


def _in_process(target: Target) -> Target:
    """`target` as its sandbox's child runs it: in that process."""
    inner = copy.copy(target)
    inner.isolation = IN_PROCESS
    return inner


def _key(header: Header, ops: Ops) -> str:
    return hashlib.sha1(dumps(header, ops).encode()).hexdigest()


def _replay_repairing(
    target: Target, header: Header, ops: Ops, on_step: Callable[[Run], None] | None = None
) -> Tuple[Optional[str], Ops]:
    """Replay, skipping operations the model rejects before changing anything. Returns the
    divergence kind (None if none) and the operations applied, up to and including the one
    that diverged. `on_step` sees the run after each operation that applied cleanly. An isolated
    target replays in a child (`on_step` is then not called: the run stays in the child), where
    a death is a divergence of its kind like any other."""
    if target.isolation.enabled:
        try:
            return sandbox.call(target.isolation, _replay_repairing, _in_process(target), header, ops)
        except sandbox.SubjectDied as died:
            return died.kind, list(died.ops)
    try:
        lock = target.start(header)
    except Exception:  # a header the managers refuse (or a subject that fails as it is built)
        return None, []
    return _continue(lock, ops, on_step)


def _continue(lock: Run, ops: Ops, on_step: Callable[[Run], None] | None = None) -> Tuple[Optional[str], Ops]:
    for op in ops:
        try:
            lock.apply(op)
        except InvalidOp:
            # A bad stop list changes nothing either, but a candidate that left one behind is
            # dropped whole: skipping those steps instead made the search slower (the long fuzz
            # walk of tests/checker/test_minimize.py no longer reached 10 operations in its replays).
            if _stop(op.op):
                return None, []
            continue
        except Finding as e:
            return e.kind, list(lock.ops)
        except Exception:  # the reference itself crashed: not the failure we are after
            return None, []
        if on_step is not None:
            on_step(lock)
    return None, list(lock.ops)


class _Checkpoints:
    """Copies of the harness along the current trace: a candidate sharing its first n
    operations resumes from the copy at n instead of replaying from the start. Long traces
    only (a copy costs about as much as a dozen operations)."""

    MIN_OPS = 64

    def __init__(self, n_ops: int = 0) -> None:
        self.every = max(16, n_ops // 40)
        self.saved: List[Tuple[int, Run]] = []

    def record(self, lock: Run) -> None:
        if len(lock.ops) % self.every == 0:
            try:
                self.saved.append((len(lock.ops), lock.copy()))
            except Exception:  # a subject that cannot be copied: every candidate replays from the start
                self.every = sys.maxsize

    def resume(self, limit: int) -> Optional[Tuple[int, Run]]:
        """A fresh copy of the latest checkpoint at or before operation `limit`."""
        best = None
        for n, lock in self.saved:
            if n <= limit:
                best = (n, lock)
        return None if best is None else (best[0], best[1].copy())


def _common_prefix(a: Ops, b: Ops) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class _Minimizer:
    def __init__(
        self,
        header: Header,
        ops: Ops,
        kind: str,
        deadline: float,
        log: Callable[[str], None],
        max_replays: Optional[int] = None,
        target: Optional[Target] = None,
    ) -> None:
        self.target: Target = target or LockstepTarget()
        self.header, self.ops, self.kind = header, ops, kind
        self.deadline = deadline
        self.max_replays = max_replays
        self.log = log
        # candidate key -> (passes, applied ops, replayed from the start?)
        self.cache: Dict[str, Tuple[bool, Ops, bool]] = {}
        self.tests = 0
        self.strict = False  # replay every candidate from the start (the final pass)
        self.checkpoints = _Checkpoints()
        self._rebuild_checkpoints()  # the input failed this way already: this only records

    # -- the oracle -------------------------------------------------------------------------
    def test(self, ops: Ops, header: Header | None = None) -> bool:
        """Does the candidate still fail the same way? On success it becomes the current trace."""
        header = header or self.header
        ops = [_tidy(op) for op in ops]
        key = _key(header, ops)
        if key not in self.cache or (self.strict and not self.cache[key][2]):
            if time.monotonic() > self.deadline or (self.max_replays is not None and self.tests >= self.max_replays):
                raise _OutOfTime
            self.tests += 1
            self.cache[key] = self._evaluate(header, ops)
        same, applied, fresh = self.cache[key]
        if not same or _size(header, applied) >= _size(self.header, self.ops):
            return False  # not the failure, or no simpler than what we have (avoids cycles)
        old = (self.header, self.ops)
        self.header, self.ops = header, applied
        if not self._rebuild_checkpoints(verify=not fresh):
            self.header, self.ops = old  # a resumed copy disagreed with a fresh replay
            self.cache[key] = (False, applied, True)
            return False
        return True

    def _evaluate(self, header: Header, ops: Ops) -> Tuple[bool, Ops, bool]:
        start = None
        if not self.strict and header == self.header:
            start = self.checkpoints.resume(_common_prefix(ops, self.ops))
        if start is None:
            kind, applied = _replay_repairing(self.target, header, ops)
            return kind == self.kind, applied, True
        n, lock = start
        kind, applied = _continue(lock, ops[n:])
        return kind == self.kind, applied, False

    def _rebuild_checkpoints(self, verify: bool = False) -> bool:
        """Checkpoints along the (new) current trace, from a replay from the start that must
        fail the same way: no candidate is accepted on the word of a resumed copy alone."""
        self.checkpoints = _Checkpoints(len(self.ops))
        # short traces replay from the start anyway; an isolated target's runs live in its children
        short = len(self.ops) < _Checkpoints.MIN_OPS or self.target.isolation.enabled
        if short and not verify:
            return True
        kind, applied = _replay_repairing(
            self.target, self.header, self.ops, None if short else self.checkpoints.record
        )
        if kind != self.kind or applied != self.ops:
            self.checkpoints = _Checkpoints()
            return False
        return True

    # -- passes -----------------------------------------------------------------------------
    def remove_requests(self) -> bool:
        progress = False
        uids = _submitted_uids(self.ops)
        size = max(len(uids) // 2, 1)
        while size >= 1 and uids:
            i = 0
            while i < len(uids):
                group = set(uids[i : i + size])
                if self.test(_without_uids(self.ops, group)):
                    progress = True
                    uids = _submitted_uids(self.ops)
                else:
                    i += size
            size //= 2
        return progress

    def remove_ops(self, single_only: bool = False) -> bool:
        progress = False
        size = 1 if single_only else max(len(self.ops) // 2, 1)
        while size >= 1:
            i = 0
            while i < len(self.ops):
                if self.test(self.ops[:i] + self.ops[i + size :]):
                    progress = True
                else:
                    i += size
            size //= 2
        return progress

    def merge_prefills(self) -> bool:
        """Two prefills in a row become one with both budgets (one chunking step fewer)."""
        progress = False
        i = 0
        while i + 1 < len(self.ops):
            a, b = self.ops[i], self.ops[i + 1]
            if isinstance(a.op, Prefill) and isinstance(b.op, Prefill) and not a.op.stop:
                merged = _set(b, budget=a.op.budget + b.op.budget)
                if self.test(self.ops[:i] + [merged] + self.ops[i + 2 :]):
                    progress = True
                    continue
            i += 1
        return progress

    def simplify_values(self) -> bool:
        progress = False
        for i in range(len(self.ops)):
            if i >= len(self.ops):
                break
            for field, kind, low in _simplifiable_fields(self.ops[i]):
                if kind == "int":
                    progress |= self._shrink_int(i, field, low)
                else:
                    progress |= self._shrink_list(i, field, low, zero=(kind == "tokens"))
        return progress

    def _with(self, i: int, field: str, value: int | List[int]) -> bool:
        typed = tuple(value) if isinstance(value, list) else value
        return self.test(self.ops[:i] + [_set(self.ops[i], **{field: typed})] + self.ops[i + 1 :])

    def _current(self, i: int, field: str, op_kind: type) -> Any:
        """The field's value now (None if a repair dropped or replaced op i, or left the field out)."""
        if i < len(self.ops) and type(self.ops[i].op) is op_kind and field not in self.ops[i].absent:
            value = getattr(self.ops[i].op, field)
            return list(value) if isinstance(value, tuple) else value
        return None

    def _shrink_int(self, i: int, field: str, low: int) -> bool:
        """Binary search for the smallest value that still fails (assuming rough monotony)."""
        op_kind, value = type(self.ops[i].op), getattr(self.ops[i].op, field)
        if value <= low:
            return False
        if self._with(i, field, low):
            return True
        lo, hi, progress = low, value, False  # lo: loses the failure, hi: keeps it
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._current(i, field, op_kind) is None:
                break
            if self._with(i, field, mid):
                hi, progress = mid, True
            else:
                lo = mid
        return progress

    def _shrink_list(self, i: int, field: str, min_len: int, zero: bool) -> bool:
        """ddmin over the list's items, then (token lists) values lowered to 0."""
        op_kind, progress = type(self.ops[i].op), False
        values = self._current(i, field, op_kind) or []
        if min_len == 0 and values and self._with(i, field, []):
            return True
        size = len(values) // 2
        while size >= 1:
            j = 0
            while j < len(values):
                cand = values[:j] + values[j + size :]
                if len(cand) >= min_len and self._with(i, field, cand):
                    progress = True
                    values = self._current(i, field, op_kind)
                    if values is None:
                        return progress
                else:
                    j += size
            size //= 2
        if zero and any(values):
            if self._with(i, field, [0] * len(values)):
                return True
            for j in range(len(values)):
                if values[j] and self._with(i, field, values[:j] + [0] + values[j + 1 :]):
                    progress = True
                    values = self._current(i, field, op_kind)
                    if values is None:
                        return progress
        return progress

    def shrink_pool(self) -> bool:
        """Binary search for fewer pages and table slots: a smaller pool often fails sooner,
        and a replay stops at the divergence, so this can cut a long trace at once."""
        progress = False
        for field in ("num_pages", "table_slots"):
            lo, hi = 0, getattr(self.header, field)  # lo: loses the failure, hi: keeps it
            while hi - lo > 1:
                mid = (lo + hi) // 2 if lo else 1  # try the smallest first
                if self.test(self.ops, replace(self.header, **{field: mid})):  # type: ignore[arg-type]
                    hi, progress = mid, True
                else:
                    lo = mid
        return progress

    def shrink_header(self) -> bool:
        progress = False
        for header in _header_candidates(self.header, self.ops):
            if header != self.header and self.test(self.ops, header):
                progress = True
        return progress

    def renumber(self) -> bool:
        progress = False
        for ops in (_renumbered(self.ops), _relabeled_tokens(self.ops)):
            if ops != self.ops and self.test(ops):
                progress = True
        return progress

    def run(self) -> bool:
        """Returns True when the result is 1-minimal, False if the budget ran out first."""
        # the pool first (it can end a long trace sooner), the header early: smaller pages make
        # every later replay cheaper and many steps removable
        passes = [
            ("pool", self.shrink_pool),
            ("requests", self.remove_requests),
            ("header", self.shrink_header),
            ("ops", self.remove_ops),
            ("merge", self.merge_prefills),
            ("values", self.simplify_values),
            ("renumber", self.renumber),
        ]
        try:
            while True:
                progress = False
                for name, fn in passes:
                    before = len(self.ops)
                    if fn():
                        progress = True
                        self.log(f"  {name:8s} pass: {before} -> {len(self.ops)} ops ({self.tests} replays)")
                # values/header/uid changes may free an op: the last word is single-op removal,
                # every candidate replayed from the start
                if not progress:
                    self.strict = True
                    if not self.remove_ops(single_only=True):
                        return True
                    self.strict = False
        except _OutOfTime:
            return False


def _size(header: Header, ops: Ops) -> Tuple[int, ...]:
    """Smaller is simpler: fewer ops, then smaller values, then a smaller header (page size
    first: with small pages fewer steps cross a page), then uids numbered densely in submission
    order, then smaller token values. Every accepted candidate is strictly smaller, so the
    passes terminate."""
    values = sum(_op_magnitude(op) for op in ops)
    uid_cost = sum(abs(uid - i) for i, uid in enumerate(_submitted_uids(ops)))
    token_values = sum(sum(_sample(r.op)) + (sum(r.op.tokens) if isinstance(r.op, (Submit, Probe)) else 0) for r in ops)
    return (
        len(ops),
        values,
        header.page_size,
        header.page_size * header.num_pages,
        header.num_pages,
        header.table_slots,
        header.max_seq_len,
        uid_cost,
        token_values,
    )


def _op_magnitude(line: OpRecord) -> int:
    match line.op:
        case Submit(_, tokens, max_tokens):
            return len(tokens) + max_tokens
        case Probe(tokens):
            return len(tokens)
        case Evict(tokens):
            return tokens
        case Prefill(budget, sample, stop):
            return budget + len(sample) + len(stop)
        case Decode(sample, stop):
            return len(sample) + len(stop)
    return 0


def _sample(op: CacheOp) -> Tuple[int, ...]:
    return op.sample if isinstance(op, (Prefill, Decode)) else ()


def _stop(op: CacheOp) -> Tuple[int, ...]:
    return op.stop if isinstance(op, (Prefill, Decode)) else ()


def _set(line: OpRecord, **values: Any) -> OpRecord:
    """`line` with fields of its operation replaced (each one then written, even when empty)."""
    return OpRecord(replace(line.op, **values), line.expect, line.absent - set(values))


def _tidy(line: OpRecord) -> OpRecord:
    """An empty stop list says nothing: leave it out."""
    if isinstance(line.op, (Prefill, Decode)) and not line.op.stop and "stop" not in line.absent:
        return OpRecord(line.op, line.expect, line.absent | {"stop"})
    return line


def _submitted_uids(ops: Ops) -> List[int]:
    return [r.op.uid for r in ops if isinstance(r.op, Submit)]


def _without_uids(ops: Ops, uids: Set[int]) -> Ops:
    out = []
    for r in ops:
        if isinstance(r.op, _UID_OPS) and r.op.uid in uids:
            continue
        stop = _stop(r.op)
        if stop:
            r = _set(r, stop=tuple(u for u in stop if u not in uids))
        out.append(r)
    return out


def _smaller_ints(value: int, low: int) -> Iterator[int]:
    for v in (low, value // 2, value - 1):
        if low <= v < value:
            yield v


def _simplifiable_fields(line: OpRecord) -> List[Tuple[str, str, int]]:
    """(field, "int" | "tokens" | "list", lowest value or shortest length) for each field of
    `line`'s operation the values pass may shrink."""
    op = line.op
    fields: List[Tuple[str, str, int]] = []
    if isinstance(op, (Submit, Probe)):
        fields.append(("tokens", "tokens", 1 if isinstance(op, Submit) else 0))
    if isinstance(op, Submit):
        fields.append(("max_tokens", "int", 1))
    if isinstance(op, Prefill):
        fields.append(("budget", "int", 1))
    if isinstance(op, (Prefill, Decode)):
        fields.append(("sample", "tokens", 0))
        if op.stop:
            fields.append(("stop", "list", 0))
    if isinstance(op, Evict):
        fields.append(("tokens", "int", 0))
    return fields


def _header_candidates(header: Header, ops: Ops) -> Iterator[Header]:
    for v in _smaller_ints(header.num_pages, 1):
        yield replace(header, num_pages=v)
    for v in _smaller_ints(header.table_slots, 1):
        yield replace(header, table_slots=v)
    longest = max((len(r.op.tokens) + r.op.max_tokens for r in ops if isinstance(r.op, Submit)), default=1)
    for ps in [p for p in PAGE_SIZES if p < header.page_size]:
        # the same pool in smaller pages (at most 64 more pages: every step costs per page),
        # then as many pages of the smaller size
        pool = min(header.num_pages * header.page_size // ps, max(header.num_pages, 64))
        for num_pages in (pool, header.num_pages) if pool != header.num_pages else (pool,):
            yield replace(header, page_size=ps, num_pages=num_pages, max_seq_len=_round_up(header.max_seq_len, ps))
    # max_seq_len stays a multiple of the page size: a row must hold whole pages
    for v in (longest, header.max_seq_len // 2, header.max_seq_len - header.page_size):
        v = _round_up(max(v, longest), header.page_size)
        if v < header.max_seq_len:
            yield replace(header, max_seq_len=v)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _renumbered(ops: Ops) -> Ops:
    new = {uid: i for i, uid in enumerate(_submitted_uids(ops))}
    out = []
    for r in ops:
        if isinstance(r.op, _UID_OPS) and r.op.uid in new:
            r = _set(r, uid=new[r.op.uid])
        stop = _stop(r.op)
        if stop:
            r = _set(r, stop=tuple(new.get(u, u) for u in stop))
        out.append(r)
    return out


def _relabeled_tokens(ops: Ops) -> Ops:
    """Token values renamed 0, 1, 2, ... in order of first appearance (prompts, probes, samples)."""
    names: Dict[int, int] = {}

    def rename(tokens: Sequence[int]) -> Tuple[int, ...]:
        return tuple(names.setdefault(t, len(names)) for t in tokens)

    out = []
    for r in ops:
        if isinstance(r.op, (Submit, Probe)):
            r = _set(r, tokens=rename(r.op.tokens))
        if _sample(r.op):
            r = _set(r, sample=rename(_sample(r.op)))
        out.append(r)
    return out


def minimize(
    header: Header,
    ops: Sequence[TraceLine],
    budget: float = 60.0,
    log: Callable[[str], None] | None = None,
    max_replays: Optional[int] = None,
    target: Optional[Target] = None,
) -> Tuple[Header, Ops, str]:
    """Shrink a failing trace within `budget` seconds (math.inf: no time limit) and at most
    `max_replays` candidate replays; returns (header, ops, fingerprint). A replay count, unlike
    seconds, gives the same result on a loaded machine: tests bound the work with it.

    Raises MinimizeError if the trace does not fail (or is invalid). If the budget runs out the
    best trace so far is returned (log says so); otherwise the result is 1-minimal. `target`
    (default: reference against fast) replays the candidates; the caller keeps it active.
    """
    log = log or (lambda msg: None)
    target = target or LockstepTarget()
    start = time.monotonic()
    kind, step, applied = _fingerprint(target, header, ops)
    log(f"fingerprint {kind} at step {step} of {len(ops)}")
    lines = list(applied)
    if not kind.startswith("expect:") and any(r.expect is not None for r in lines):
        # recorded expectations only get in the way of shrinking
        stripped = [replace(r, expect=None) for r in lines]
        kind2, _ = _replay_repairing(target, header, stripped)
        if kind2 == kind:
            lines = stripped
    m = _Minimizer(header, lines, kind, start + budget, log, max_replays, target)
    complete = m.run()
    log(
        f"{'1-minimal' if complete else 'budget exhausted (result may not be 1-minimal)'}: "
        f"{len(m.ops)} ops after {m.tests} replays in {time.monotonic() - start:.1f}s"
    )
    out_header = target.trace_header(m.header, "minimize")
    return out_header, m.ops, kind


def main_minimize(
    path: str,
    output: str,
    budget: float = 60.0,
    bug: str | None = None,
    max_replays: Optional[int] = None,
    target: Optional[Target] = None,
) -> int:
    """`kvledger minimize TRACE -o OUT` on `target` (default: reference against fast with `bug`):
    exit 0 with the minimized trace written, 1 when a subject's trace replays clean, 2 on an error."""
    from kvledger.checker.targets import lockstep_target
    from kvledger.engine.ledger.trace import TraceError, read, write

    target = target or lockstep_target(bug)
    try:
        header, ops = read(path)
    except (OSError, TraceError) as e:
        print(f"kvledger minimize: {path}: {e}", file=sys.stderr)
        return 2
    if isinstance(target, SubjectTarget):
        return _main_minimize_subject(path, output, budget, max_replays, target, header, ops)
    try:
        with target.active():
            start = time.monotonic()
            m_header, m_ops, kind = minimize(header, ops, budget=budget, log=_log.info, max_replays=max_replays)
    except (MinimizeError, KeyError) as e:
        print(f"kvledger minimize: {path}: {e}", file=sys.stderr)
        return 2
    write(output, m_header, m_ops)
    print(f"{len(ops)} -> {len(m_ops)} operations in {time.monotonic() - start:.1f}s, fingerprint {kind}: {output}")
    bug = target.bug
    print(f"replay it: kvledger replay {output}" + (f"  (needs bug {bug!r} patched in)" if bug else ""))
    return 0


# -- a subject's traces: the operations only ---------------------------------------------------------
# A subject's replay costs milliseconds where lockstep's costs microseconds, and a subject accepts
# only some page sizes: its traces are shrunk by delta debugging over the operations (drop chunks,
# then single operations), then simpler operations (shorter prompts, smaller max_tokens, budgets
# and stops), each candidate replayed from scratch on a fresh subject, an operation the driver
# refuses at its new point skipped. `shortest_failure` also tries short random cases of the same
# kind, since a trace can only lose operations. Stops after `budget` seconds or `max_replays`
# candidates (the second gives the same result on any machine).
# subject_walk.case_runner(factory, page_sizes, max_ops, isolation): a context manager whose value
# plays case (number, seed) of the subject fuzzer (injected: subject_walk imports this module)
CaseRunner = Callable[..., Any]


def _subject_replay(
    replayer: Replayer, config: SubjectConfig, ops: Sequence[TraceLine]
) -> Tuple[Optional[Finding], Ops]:
    """The first finding on a fresh subject (None if none) and the operations that applied; in
    the target's sandbox, where a death is the finding."""
    target = replayer.target
    finding, applied = replayer(header_of(config, None, "minimize", target.name, ""), ops)
    return finding, list(applied or [])


def minimize_ops(
    factory: Union[Callable[[SubjectConfig], Subject], SubjectTarget],
    config: SubjectConfig,
    ops: Sequence[TraceLine],
    kind: str,
    budget: float = 60.0,
    max_replays: int | None = None,
) -> Tuple[Ops, Finding | None]:
    """A subject's failing `ops` on `config` shrunk keeping the finding's `kind`: (ops, finding)."""
    target = factory if isinstance(factory, SubjectTarget) else SubjectTarget(factory, "subject")
    with Replayer(target) as replayer:
        return _minimize_ops(replayer, config, ops, kind, time.monotonic() + budget, max_replays)


def _minimize_ops(
    replayer: Replayer,
    config: SubjectConfig,
    ops: Sequence[TraceLine],
    kind: str,
    deadline: float,
    max_replays: int | None,
) -> Tuple[Ops, Finding | None]:
    replays = [0]

    def fails(candidate: Ops) -> Tuple[bool, Ops, Finding | None]:
        replays[0] += 1
        finding, applied = _subject_replay(replayer, config, candidate)
        return (finding is not None and finding.kind == kind), applied, finding

    def out_of_budget() -> bool:
        return time.monotonic() > deadline or (max_replays is not None and replays[0] >= max_replays)

    lines = [as_record(op) for op in ops]
    ok, current, finding = fails(lines)
    if not ok:
        return lines, finding
    while not out_of_budget():
        before = list(current)
        current, finding = _drop(current, finding, fails, out_of_budget)
        current, finding = _simplify(current, finding, fails, out_of_budget)
        if current == before:
            break
    renumbered = _renumber_by_submission(current)
    if renumbered != current and not out_of_budget():
        ok, applied, f = fails(renumbered)
        if ok and len(applied) == len(renumbered):
            current, finding = applied, f
    _log.debug("minimized %d ops to %d in %d replays", len(ops), len(current), replays[0])
    return current, finding


Fails = Callable[[Ops], Tuple[bool, Ops, Optional[Finding]]]


def _drop(
    current: Ops, finding: Finding | None, fails: Fails, out_of_budget: Callable[[], bool]
) -> Tuple[Ops, Finding | None]:
    """Delta debugging: drop chunks of operations, halving the chunk until single operations."""
    chunk = max(len(current) // 2, 1)
    while chunk >= 1 and not out_of_budget():
        i, shrunk = 0, False
        while i < len(current) and not out_of_budget():
            ok, applied, f = fails(current[:i] + current[i + chunk :])
            if ok:
                current, finding, shrunk = applied, f, True
            else:
                i += chunk
        if not shrunk:
            chunk //= 2
    return current, finding


def _simplify(
    current: Ops, finding: Finding | None, fails: Fails, out_of_budget: Callable[[], bool]
) -> Tuple[Ops, Finding | None]:
    """Simpler operations one at a time; a change that makes later operations moot (they are then
    skipped or become no-ops for `_drop`) is kept as long as the finding is."""
    i = 0
    while i < len(current) and not out_of_budget():
        for simpler in _simpler(current[i]):
            ok, applied, f = fails(current[:i] + [simpler] + current[i + 1 :])
            if ok and len(applied) <= len(current):
                current, finding = applied, f
                break
        else:
            i += 1
    return current, finding


def _renumber_by_submission(ops: Ops) -> Ops:
    """uids 0, 1, 2, ... in submission order, for a reader."""
    new: Dict[int, int] = {}
    for uid in _submitted_uids(ops):
        new.setdefault(uid, len(new))

    out = []
    for r in ops:
        if isinstance(r.op, _UID_OPS):
            r = _set(r, uid=new.get(r.op.uid, r.op.uid))
        stop = _stop(r.op)
        if stop:
            r = _set(r, stop=tuple(new.get(u, u) for u in stop))
        out.append(r)
    return out


def _simpler(line: OpRecord) -> Ops:
    op, out = line.op, []
    if isinstance(op, Submit):
        for n in range(1, len(op.tokens)):
            out.append(_set(line, tokens=op.tokens[:n]))
        if op.max_tokens > 1:
            out.append(_set(line, max_tokens=1))
            out.append(_set(line, max_tokens=op.max_tokens - 1))
    elif isinstance(op, (Prefill, Decode)):
        if op.stop:
            out.append(_set(line, stop=()))
        if isinstance(op, Prefill) and op.budget < 64:
            out.append(_set(line, budget=64))
        if len(op.sample) > 1:
            out.append(_set(line, sample=op.sample[:1]))
    return [o for o in out if o != line]


def _main_minimize_subject(
    path: str, output: str, budget: float, max_replays: int | None, target: SubjectTarget, header: Header, ops: Ops
) -> int:
    config = config_of(header)
    with Replayer(target) as replayer:
        finding, _ = _subject_replay(replayer, config, ops)
    if finding is None:
        print(f"{path}: replays clean on {target.name}; nothing to minimize")
        return 1
    small, finding = minimize_ops(target, config, ops, finding.kind, budget, max_replays)
    trace.write(output, header_of(config, header.seed, "kvledger fuzz --subject", target.name, target.version), small)
    assert finding is not None  # the input's kind, kept by every accepted candidate
    print(f"[{finding.kind}] {finding.message}")
    print(f"minimized {len(ops)} operations to {len(small)}: {output}")
    for op in small:
        print("  " + json.dumps(op.to_json()))
    if finding.detail.strip():  # from the replay of the minimized trace, not of the input
        print(f"the minimized trace's traceback:\n{finding.detail.rstrip()}")
    return 0


def shortest_failure(
    factory: Union[Callable[[SubjectConfig], Subject], SubjectTarget],
    kind: str,
    ops: Sequence[TraceLine],
    config: SubjectConfig,
    finding: Finding | None,
    page_sizes: Sequence[int],
    budget: float = 20.0,
    cases: int = 200,
    max_ops: int = 6,
    *,
    case_runner: CaseRunner,
    max_replays: Optional[int] = None,
) -> Tuple[Ops, SubjectConfig, Finding | None]:
    """A minimized trace can only lose operations, so a failure reached the long way (a pool
    filled by many decodes) stays long. This also searches short random cases (`case_runner`, the
    subject fuzzer's: `max_ops` before the drain, case seeds from 10**9) for the same kind of
    finding, minimizes each one found, and returns the shortest of all (its ops, config, finding);
    deterministic for a number of cases, and for `max_replays` (cases and replays together) as a
    bound instead of the seconds. Cases and replays run in the target's sandbox, each in one child
    until a death."""
    target = factory if isinstance(factory, SubjectTarget) else SubjectTarget(factory, "subject")
    deadline = time.monotonic() + budget
    best = ([as_record(op) for op in ops], config, finding)
    with case_runner(target.factory, page_sizes, max_ops, target.isolation) as run, Replayer(target) as replayer:
        for k in range(cases):
            left = 2000 if max_replays is None else max_replays - k - replayer.replays
            if time.monotonic() > deadline or len(best[0]) <= 2 or left <= 0:
                break
            result = run(0, 10**9 + k)
            if result.finding is None or result.finding.kind != kind or len(result.ops) >= 4 * len(best[0]):
                continue
            budget_left = max(deadline - time.monotonic(), 1)
            small, f = _minimize_ops(replayer, result.config, result.ops, kind, time.monotonic() + budget_left, left)
            if len(small) < len(best[0]):
                best = (small, result.config, f)
    return best
