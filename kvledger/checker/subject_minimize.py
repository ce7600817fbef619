"""Shrink a subject's failing trace, keeping its finding's kind, replaying on fresh subject instances.

Delta debugging over the operations (drop chunks, then single operations), then simplification
of what is left: shorter prompts (tokens dropped from the end), smaller max_tokens, budgets and
stops. Every candidate is replayed from scratch on a new subject (`subject_driver.replay`); an
operation the driver refuses at its new point is skipped, so removing a submit never breaks the
replay, it only changes what follows. Stops after `budget` seconds or `max_replays` candidates
(the second gives the same result on any machine).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Dict, List, Sequence, Tuple

from kvledger.engine.ledger import trace
from kvledger.properties.subject import Subject, SubjectConfig
from kvledger.properties.subject_driver import Finding, replay

log = logging.getLogger(__name__)


def minimize_ops(
    factory: Callable[[SubjectConfig], Subject],
    config: SubjectConfig,
    ops: Sequence[Dict[str, Any]],
    kind: str,
    budget: float = 60.0,
    max_replays: int | None = None,
) -> Tuple[List[Dict], Finding | None]:
    deadline = time.monotonic() + budget
    replays = [0]

    def fails(candidate: List[Dict]) -> Tuple[bool, List[Dict], Finding | None]:
        replays[0] += 1
        finding, applied = replay(factory, config, candidate)
        return (finding is not None and finding.kind == kind), applied, finding

    def out_of_budget() -> bool:
        return time.monotonic() > deadline or (max_replays is not None and replays[0] >= max_replays)

    ok, current, finding = fails(list(ops))
    if not ok:
        return list(ops), finding
    while not out_of_budget():
        before = len(current), json.dumps(current)
        current, finding = _drop(current, finding, fails, out_of_budget)
        current, finding = _simplify(current, finding, fails, out_of_budget)
        if (len(current), json.dumps(current)) == before:
            break
    renumbered = _renumber(current)
    if renumbered != current and not out_of_budget():
        ok, applied, f = fails(renumbered)
        if ok and len(applied) == len(renumbered):
            current, finding = applied, f
    log.info("minimized %d ops to %d in %d replays", len(ops), len(current), replays[0])
    return current, finding


def _drop(
    current: List[Dict], finding: Finding | None, fails: Callable, out_of_budget: Callable
) -> Tuple[List[Dict], Finding | None]:
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
    current: List[Dict], finding: Finding | None, fails: Callable, out_of_budget: Callable
) -> Tuple[List[Dict], Finding | None]:
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


def _renumber(ops: List[Dict]) -> List[Dict]:
    """uids 0, 1, 2, ... in submission order, for a reader."""
    new: Dict[int, int] = {}
    for op in ops:
        if op["op"] == "submit":
            new.setdefault(op["uid"], len(new))

    def uid(u: int) -> int:
        return new.get(u, u)

    out = []
    for op in ops:
        op = dict(op)
        if "uid" in op:
            op["uid"] = uid(op["uid"])
        if op.get("stop"):
            op["stop"] = [uid(u) for u in op["stop"]]
        out.append(op)
    return out


def _simpler(op: Dict[str, Any]) -> List[Dict[str, Any]]:
    out = []
    if op["op"] == "submit":
        tokens = op["tokens"]
        for n in range(1, len(tokens)):
            out.append({**op, "tokens": tokens[:n]})
        if op["max_tokens"] > 1:
            out.append({**op, "max_tokens": 1})
            out.append({**op, "max_tokens": op["max_tokens"] - 1})
    elif op["op"] in ("prefill", "decode"):
        if op.get("stop"):
            out.append({**op, "stop": []})
        if op["op"] == "prefill" and op["budget"] < 64:
            out.append({**op, "budget": 64})
        if len(op.get("sample", ())) > 1:
            out.append({**op, "sample": op["sample"][:1]})
    return [o for o in out if o != op]


def main_minimize_subject(path: str, output: str, budget: float, subject: str | None, max_replays: int | None) -> int:
    from kvledger.checker.subject_fuzz import config_of, header_for
    from kvledger.subjects import parse_spec

    header, ops = trace.read(path)
    text = subject or header.subject
    if not text:
        print(f"kvledger minimize: {path} names no subject; pass --subject", flush=True)
        return 2
    spec = parse_spec(text)
    config = config_of(header)
    factory = spec.factory()
    finding, _ = replay(factory, config, ops)
    if finding is None:
        print(f"{path}: replays clean on {text}; nothing to minimize")
        return 1
    small, finding = minimize_ops(factory, config, ops, finding.kind, budget, max_replays)
    version = factory(config).version
    trace.write(output, header_for(spec, version, config, header.seed), small)
    print(f"[{finding.kind}] {finding.message}")
    print(f"minimized {len(ops)} operations to {len(small)}: {output}")
    for op in small:
        print("  " + json.dumps(op))
    return 0


def shortest_failure(
    factory: Callable[[SubjectConfig], Subject],
    kind: str,
    ops: List[Dict],
    config: SubjectConfig,
    finding: Finding | None,
    page_sizes: Sequence[int],
    budget: float = 20.0,
    cases: int = 200,
    max_ops: int = 6,
) -> Tuple[List[Dict], SubjectConfig, Finding | None]:
    """A minimized trace can only lose operations, so a failure reached the long way (a pool
    filled by many decodes) stays long. This also searches short random cases (`max_ops` before
    the drain, case seeds from 10**9) for the same kind of finding, minimizes each one found, and
    returns the shortest of all (its ops, config, finding); deterministic for a number of cases."""
    from kvledger.checker.subject_fuzz import run_case

    deadline = time.monotonic() + budget
    best = (ops, config, finding)
    for k in range(cases):
        if time.monotonic() > deadline or len(best[0]) <= 2:
            break
        result = run_case(factory, 10**9 + k, page_sizes, max_ops=max_ops)
        if result.finding is None or result.finding.kind != kind or len(result.ops) >= 4 * len(best[0]):
            continue
        small, f = minimize_ops(
            factory, result.config, result.ops, kind, budget=max(deadline - time.monotonic(), 1), max_replays=2000
        )
        if len(small) < len(best[0]):
            best = (small, result.config, f)
    return best
