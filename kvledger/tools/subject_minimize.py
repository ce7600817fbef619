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

from kvledger.engine import trace
from kvledger.engine.subject import Subject, SubjectConfig
from kvledger.properties.subject_driver import Finding, replay

log = logging.getLogger(__name__)


def minimize_ops(factory: Callable[[SubjectConfig], Subject], config: SubjectConfig, ops: Sequence[Dict[str, Any]],
                 kind: str, budget: float = 60.0, max_replays: int | None = None) -> Tuple[List[Dict], Finding | None]:
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
    chunk = max(len(current) // 2, 1)
    while chunk >= 1 and not out_of_budget():
        i, shrunk = 0, False
        while i < len(current) and not out_of_budget():
            candidate = current[:i] + current[i + chunk:]
            ok, applied, f = fails(candidate)
            if ok:
                current, finding, shrunk = applied, f, True
            else:
                i += chunk
        if not shrunk:
            chunk //= 2
    for i in range(len(current)):
        for simpler in _simpler(current[i]):
            if out_of_budget():
                break
            candidate = current[:i] + [simpler] + current[i + 1:]
            ok, applied, f = fails(candidate)
            if ok and len(applied) == len(current):
                current, finding = applied, f
    log.info("minimized %d ops to %d in %d replays", len(ops), len(current), replays[0])
    return current, finding


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
        if op["op"] == "prefill" and op["budget"] > 1:
            out.append({**op, "budget": 64 if op["budget"] < 64 else op["budget"]})
    return out


def main_minimize_subject(path: str, output: str, budget: float, subject: str | None,
                          max_replays: int | None) -> int:
    from kvledger.subjects import parse_spec
    from kvledger.tools.subject_fuzz import config_of, header_for

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
