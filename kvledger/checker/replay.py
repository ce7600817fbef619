"""`kvledger replay TRACE`: run a trace on a target (reference and fast in lockstep, or a subject in
judge mode: `--subject`, or the subject the trace's header names) and report.

Lockstep replays strictly: an operation invalid at its point is a bad trace. A subject's replay
skips such an operation, as its fuzzer never records one (a minimized trace may leave one behind),
and runs in a child process (`sandbox.py`): a trace whose subject dies (`subject-crashed:SIGSEGV`)
replays to that finding, with the stack the process died with.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, List, Optional

from kvledger.checker.isolated_runs import replay_isolated
from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import InvalidOp, OpRecord
from kvledger.engine.ledger.trace import Header, TraceError, read
from kvledger.properties.lockstep import Lockstep
from kvledger.properties.subject import SubjectUnavailable
from kvledger.properties.target import LockstepTarget, Target, replay

log = logging.getLogger(__name__)


def replay_file(path: str, device: str = "cpu", bug: Optional[str] = None) -> int:
    """Reference against fast (`bug` patched into fast first): `replay_trace` on a lockstep target."""
    from kvledger.checker.targets import lockstep_target

    return replay_trace(path, lockstep_target(bug, device))


def replay_trace(path: str, target: Target) -> int:
    """Exit 0 when the trace holds on `target`, 1 on a finding, 2 on a bad trace, an invalid
    operation (lockstep), a subject that cannot be built or an unknown bug."""
    try:
        header, ops = read(path)
    except (OSError, TraceError) as e:
        print(f"kvledger replay: {e}", file=sys.stderr)
        return 2
    run: Any = None
    try:
        with target.active():
            if target.isolation.enabled:  # in a child: a trace that kills its process is reported, not obeyed
                finding, ran = replay_isolated(target, header, ops)
            else:
                finding, run = replay(target, header, ops)
                ran = None if run is None else list(run.ops)
    except KeyError as e:
        print(f"kvledger replay: {e.args[0]}", file=sys.stderr)
        return 2
    except InvalidOp as e:
        print(
            f"kvledger replay: {path}: operation {getattr(e, 'step', '?')} is invalid at that point: {e}",
            file=sys.stderr,
        )
        return 2
    except SubjectUnavailable as e:
        print(f"kvledger replay: {e}", file=sys.stderr)
        return 2
    _warn_on_another_version(path, header, target)
    applied: List[OpRecord] = ran or []
    if finding is not None:
        print("\n".join(_finding_lines(target, finding)))
        return 1
    if isinstance(run, Lockstep):
        print(_lockstep_ok(header, len(ops), run))
    else:
        print(
            f"OK: {len(applied)} of {len(ops)} operations applied on {target.name}; every invariant held "
            f"({len(ops) - len(applied)} refused as invalid at their point)"
        )
    return 0


def _warn_on_another_version(path: str, header: Header, target: Target) -> None:
    version = getattr(target, "version", None)  # "unknown": no subject answered (its process died first)
    if version in (None, "unknown"):
        return
    if header.subject_version and target.name == header.subject and version != header.subject_version:
        log.warning("%s was recorded on %s %s; replaying on %s", path, target.name, header.subject_version, version)


def _finding_lines(target: Target, f: Finding) -> List[str]:
    op = (f.op or {}).get("op")
    if isinstance(target, LockstepTarget):
        return [f"DIVERGED at step {f.step} ({op}): {f.kind}", f"  operation: {f.op}", f"  {f.message}"]
    where = f"at operation {f.step} ({op})" if f.step is not None else "building the subject"
    lines = [f"FOUND {where}: [{f.kind}] {f.message}"]
    if f.detail:
        lines.append(f.detail.rstrip())
    return lines


def _lockstep_ok(header: Header, n_ops: int, lock: Lockstep) -> str:
    ref = lock.ref
    admission = header.admission + (f" (reserve_ratio {header.reserve_ratio})" if ref.policy.preempts else "")
    return (
        f"OK: {n_ops} operations agree on reference and fast ({header.cache_type} cache, page size "
        f"{header.page_size}, {header.num_pages} pages, {admission} admission); live requests at the end: "
        f"{len(ref.live)}, free pages: {len(ref.cm.free_slots)}, cached tokens: "
        f"{ref.cm.prefix_cache.size_info.total_size}; preemptions: {ref.preemptions}, recomputed tokens: "
        f"{ref.recomputed_tokens}"
    )
