"""The checker's campaigns: `kvledger fuzz --tasks N`, `kvledger check --tasks N` (with
`--cluster ADDRESS` to run them on a Ray cluster), each a list of seeded tasks and a merge.

- **fuzz**: task i runs cases `case_seed(seed, i, 0..cases-1)` of the lockstep fuzzer (or, with
  `--subject`, of the subject's judge-mode fuzzer) and stops at its first finding. The merge sums
  the counts, unions the rare events reached, and keeps one finding per kind (the first, by task
  and case), written to the campaign directory, minimized once, with the command that replays it.
- **check**: task i runs the Hypothesis lockstep machine for `examples` sequences under the
  Hypothesis seed `check_seed(seed, i)`. The merge unions the rare events and keeps the first
  failure of each kind, with its shrunk trace.

A task is a pure function of its arguments, so the campaign of N tasks is reproducible task by
task, on any executor: a finding names its task and case and replays alone on a laptop.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kvledger.campaign import CampaignDir, CampaignRun, Executor, Outcome, Task, run_campaign

log = logging.getLogger(__name__)

TASK_LIMIT_S = 1800.0  # a task still running after this long is stopped and reported as hung


def check_seed(seed: int, task: int) -> int:
    digest = hashlib.sha256(f"kvledger-check/{seed}/{task}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


# -- tasks (run in a worker: a local process or a Ray worker) -------------------------------------
def fuzz_shard(
    seed: int, shard: int, cases: int, bug: Optional[str] = None, admission: Optional[str] = None
) -> Dict[str, Any]:
    """Cases 0..cases-1 of fuzz worker `shard` under `seed` (kvledger fuzz's case seeds), with a
    bug-zoo bug patched in if named; stops at the first finding."""
    import torch

    from kvledger.checker.fuzz import OP_LIMIT_S, OpTimeout, case_seed, limited_steps, make_case, walk
    from kvledger.properties.lockstep import Finding, Lockstep
    from kvledger.reference import events
    from kvledger.subjects.fast_zoo import patched

    torch.set_num_threads(1)
    first: Dict[str, int] = {}  # rare event -> the case that first reached it
    number = 0

    def reached(name: str) -> None:
        first.setdefault(name, number)

    out: Dict[str, Any] = {"ops": 0, "cases": 0, "preemptions": 0, "optimistic_cases": 0, "finding": None}
    events.set_listener(reached)
    started = time.perf_counter()
    try:
        with patched(bug):
            for number in range(cases):
                cseed = case_seed(seed, shard, number)
                lock = Lockstep(make_case(cseed, admission).header)
                finding = None
                try:
                    for _ in limited_steps(walk(cseed, lock, reached, lambda: True, admission=admission), OP_LIMIT_S):
                        out["ops"] += 1
                except OpTimeout:
                    last = lock.ops[-1].get("op") if lock.ops else None
                    finding = {
                        "kind": "hang",
                        "detail": f"operation {len(lock.ops)} ({last}) ran past {OP_LIMIT_S:g} s",
                    }
                except Finding as e:
                    finding = {"kind": e.kind, "detail": e.message, "step": e.step}
                except Exception:  # noqa: BLE001 (a crash of the code under test is a finding)
                    import traceback

                    finding = {"kind": "crash", "detail": traceback.format_exc()}
                out["preemptions"] += lock.ref.preemptions
                if finding is not None:
                    finding.update(case=number, header=asdict(lock.header), ops=list(lock.ops))
                    out["finding"] = finding
                    break
                out["cases"] += 1
                out["optimistic_cases"] += lock.header.policy.preempts
    finally:
        events.set_listener(None)
    out["events"] = sorted(first)
    out["first_case"] = first
    out["seconds"] = time.perf_counter() - started
    return out


def subject_shard(
    subject: str,
    seed: int,
    shard: int,
    cases: int,
    fix: Optional[str] = None,
    bug: Optional[str] = None,
    page_sizes: Optional[Sequence[int]] = None,
) -> Dict[str, Any]:
    """Cases 0..cases-1 of shard `shard` of a subject's judge-mode fuzzer; stops at its first finding."""
    from kvledger.checker.fuzz import case_seed
    from kvledger.checker.subject_fuzz import run_case
    from kvledger.checker.targets import edits_for
    from kvledger.subjects import parse_spec

    logging.getLogger().setLevel(logging.WARNING)
    spec = parse_spec(subject)
    factory = spec.factory(edits_for(spec, fix=fix, bug=bug))
    sizes = spec.page_sizes(tuple(page_sizes or (1, 2, 4)))
    out: Dict[str, Any] = {"ops": 0, "cases": 0, "events": {}, "finding": None}
    started = time.perf_counter()
    for number in range(cases):
        cseed = case_seed(seed, shard, number) % (1 << 62)
        result = run_case(factory, cseed, sizes)
        out["ops"] += len(result.ops)
        for name in result.events:
            out["events"][name] = out["events"].get(name, 0) + 1
        if result.finding is not None:
            f = result.finding
            out["finding"] = {
                "kind": f.kind,
                "detail": f.message,
                "traceback": f.detail,
                "case": number,
                "case_seed": cseed,
                "config": asdict(result.config),
                "ops": result.ops,
            }
            break
        out["cases"] += 1
    out["seconds"] = time.perf_counter() - started
    return out


def check_run(profile: str, examples: int, hypothesis_seed: int) -> Dict[str, Any]:
    """The lockstep Hypothesis machine for `examples` sequences under `hypothesis_seed`."""
    import os
    import tempfile

    from hypothesis import HealthCheck, seed, settings

    from kvledger.properties import machine
    from kvledger.properties.profiles import register_profiles

    register_profiles(profile)
    failures = tempfile.mkdtemp(prefix="kvledger-check-")
    os.environ["KVLEDGER_FAILURES"] = failures
    chosen = settings(
        settings.default, max_examples=examples, database=None, deadline=None, suppress_health_check=list(HealthCheck)
    )
    progress = machine.Progress()
    seeded = seed(hypothesis_seed)(machine.LockstepMachine.bind(progress))
    started = time.perf_counter()
    out: Dict[str, Any] = {"failure": None}
    try:
        from hypothesis.stateful import run_state_machine_as_test

        run_state_machine_as_test(seeded, settings=chosen)
    except AssertionError as e:
        last = Path(failures) / "hypothesis-last-failure.jsonl"
        out["failure"] = {
            "kind": getattr(e, "kind", type(e).__name__),
            "detail": str(e)[:2000],
            "trace": last.read_text() if last.exists() else None,
        }
    out.update(sequences=progress.sequences, events=sorted(progress.reached), seconds=time.perf_counter() - started)
    return out


# -- task lists ---------------------------------------------------------------------------------
def fuzz_tasks(
    seed: int, tasks: int, cases: int, bug: Optional[str], admission: Optional[str], time_limit: float = TASK_LIMIT_S
) -> List[Task]:
    args = {"seed": seed, "cases": cases, "bug": bug, "admission": admission}
    return [
        Task(f"fuzz/seed{seed}/shard{i}", f"{__name__}:fuzz_shard", {**args, "shard": i}, time_limit)
        for i in range(tasks)
    ]


def subject_tasks(
    subject: str,
    seed: int,
    tasks: int,
    cases: int,
    fix: Optional[str],
    bug: Optional[str],
    time_limit: float = TASK_LIMIT_S,
) -> List[Task]:
    args = {"subject": subject, "seed": seed, "cases": cases, "fix": fix, "bug": bug}
    return [
        Task(f"fuzz/{subject}/seed{seed}/shard{i}", f"{__name__}:subject_shard", {**args, "shard": i}, time_limit)
        for i in range(tasks)
    ]


def check_tasks(profile: str, seed: int, tasks: int, examples: int, time_limit: float = TASK_LIMIT_S) -> List[Task]:
    return [
        Task(
            f"check/seed{seed}/run{i}",
            f"{__name__}:check_run",
            {"profile": profile, "examples": examples, "hypothesis_seed": check_seed(seed, i)},
            time_limit,
        )
        for i in range(tasks)
    ]


# -- merges -------------------------------------------------------------------------------------
def _done(run: CampaignRun, tasks: Sequence[Task]) -> List[Tuple[Task, Outcome]]:
    return [(t, run.outcomes[t.key]) for t in tasks if t.key in run.outcomes]


def _task_problems(run: CampaignRun, tasks: Sequence[Task]) -> List[str]:
    lines = []
    for task, o in _done(run, tasks):
        if o.status != "done":
            tail = (o.error or "").strip().splitlines()[-1:] or [""]
            lines.append(f"  task {task.key} {o.status.upper()} after {o.attempts} attempt(s): {tail[0]}")
            lines.append(f"    replay it alone: {replay_task_command(task)}")
    return lines


def _finished(run: CampaignRun, tasks: Sequence[Task], field: str) -> Tuple[List[Tuple[Task, Dict]], Dict]:
    """The tasks that returned, with their values, and the first `field` (finding or failure) of
    each kind among them, by task order: kind -> (task, what it found)."""
    done = [(task, o.value) for task, o in _done(run, tasks) if o.status == "done"]
    first: Dict[str, Tuple[Task, Dict[str, Any]]] = {}
    for task, value in done:
        found = value.get(field)
        if found is not None:
            first.setdefault(found["kind"], (task, found))
    return done, first


def _close(
    lines: List[str], run: CampaignRun, tasks: Sequence[Task], directory: CampaignDir, found: bool, clean: str
) -> Tuple[str, int]:
    """The summary's end, and the exit status: 1 if something was found, 2 if a task did not finish."""
    if not found:
        lines.append(clean)
    lines += _task_problems(run, tasks)
    if run.interrupted:
        lines.append(f"interrupted: resume with the same options and --campaign {directory.path}")
    unfinished = any(o.status != "done" for _, o in _done(run, tasks))
    return "\n".join(lines), 1 if found else (2 if unfinished else 0)


def replay_task_command(task: Task) -> str:
    a = task.args
    if task.function.endswith(":fuzz_shard"):
        bug = f" --bug {a['bug']}" if a.get("bug") else ""
        adm = f" --admission {a['admission']}" if a.get("admission") else ""
        return f"kvledger fuzz --tasks 1 --first-task {a['shard']} --cases {a['cases']} --seed {a['seed']}{bug}{adm}"
    if task.function.endswith(":subject_shard"):
        extra = "".join(f" --{k} {a[k]}" for k in ("fix", "bug") if a.get(k))
        return (
            f"kvledger fuzz --subject {a['subject']} --tasks 1 --first-task {a['shard']} --cases {a['cases']} "
            f"--seed {a['seed']}{extra}"
        )
    return f'python -c "from {task.function.split(":")[0]} import *; print({task.function.split(":")[1]}(**{a!r}))"'


def merge_fuzz(
    run: CampaignRun,
    tasks: Sequence[Task],
    directory: CampaignDir,
    minimize_budget: float,
    minimize_replays: Optional[int],
) -> Tuple[str, int]:
    """The merged result and the exit status (1: a finding, 2: a task that did not finish)."""
    from kvledger.engine.ledger import trace
    from kvledger.engine.ledger.trace import Header

    totals = {"ops": 0, "cases": 0, "preemptions": 0, "optimistic_cases": 0}
    reached: set = set()
    corpus: Dict[str, Tuple[Task, int]] = {}  # rare event -> the first task and case that reached it
    done, findings = _finished(run, tasks, "finding")
    for task, v in done:
        for k in totals:
            totals[k] += v.get(k, 0)
        reached |= set(v["events"])
        for name, case in sorted(v.get("first_case", {}).items()):
            corpus.setdefault(name, (task, case))
    lines = [
        f"{totals['ops']:,} operations in {totals['cases']:,} complete cases over {len(run.outcomes)} of "
        f"{len(tasks)} tasks, {run.seconds:.1f}s on {run.workers} worker(s) ({run.where}): "
        f"{totals['ops'] / run.seconds if run.seconds else 0:,.0f} ops/s"
    ]
    from kvledger.checker.fuzz import _expected_events

    expected = _expected_events()
    lines.append(f"rare events reached ({len(reached & expected)}/{len(expected)}); where each was first: corpus.jsonl")
    _write_corpus(directory, corpus)
    for kind, (task, f) in sorted(findings.items()):
        bug = task.args.get("bug")
        name = f"{task.key.replace('/', '-')}-c{f['case']}"
        path = directory.findings / f"{name}.jsonl"
        header = Header(**f["header"])
        trace.write(path, header, f["ops"])
        line = f"FINDING {kind} in task {task.key}, case {f['case']}: {f['detail'].strip().splitlines()[-1]}"
        lines.append(line)
        lines.append(f"  trace: {path} ({len(f['ops'])} ops)")
        if kind not in ("crash", "hang"):
            small = _minimize(header, f["ops"], bug, minimize_budget, minimize_replays)
            if small is not None:
                m_header, m_ops, m_kind = small
                m_path = directory.findings / f"{name}-min.jsonl"
                trace.write(m_path, m_header, m_ops)
                lines.append(f"  minimized ({len(m_ops)} ops, {m_kind}): {m_path}")
                path = m_path
        lines.append(f"  replay it: kvledger replay {path}" + (f" --bug {bug}" if bug else ""))
        lines.append(f"  or its task alone: {replay_task_command(task)}")
    return _close(lines, run, tasks, directory, bool(findings), "no finding")


def _write_corpus(directory: CampaignDir, corpus: Dict[str, Tuple[Task, int]]) -> None:
    """The merged corpus: per rare event, the task and case that first reached it (by task order),
    so the next campaign, or a regression, can start from the cases that reach the rare branches."""
    import json

    lines = [
        json.dumps(
            {"event": name, "task": task.key, "case": case, "seed": task.args["seed"], "shard": task.args["shard"]}
        )
        for name, (task, case) in sorted(corpus.items())
    ]
    (directory.path / "corpus.jsonl").write_text("".join(line + "\n" for line in lines))


def _minimize(header: Any, ops: List[Dict], bug: Optional[str], budget: float, replays: Optional[int]) -> Any:
    from kvledger.checker.minimize import MinimizeError, minimize
    from kvledger.subjects.fast_zoo import patched

    try:
        with patched(bug):
            return minimize(header, ops, budget=budget, max_replays=replays)
    except MinimizeError as e:
        log.warning("could not minimize: %s", e)
        return None


def merge_subject(
    run: CampaignRun,
    tasks: Sequence[Task],
    directory: CampaignDir,
    minimize_budget: float,
    minimize_replays: Optional[int],
) -> Tuple[str, int]:
    from kvledger.checker.subject_fuzz import header_for, minimize_finding
    from kvledger.checker.targets import edits_for
    from kvledger.engine.ledger import trace
    from kvledger.properties.subject import SubjectConfig
    from kvledger.subjects import parse_spec

    ops = cases = 0
    events: Dict[str, int] = {}
    done, findings = _finished(run, tasks, "finding")
    for _, v in done:
        ops += v["ops"]
        cases += v["cases"]
        for name, n in v["events"].items():
            events[name] = events.get(name, 0) + n
    rate = ops / run.seconds if run.seconds else 0.0
    lines = [
        f"{ops:,} operations in {cases:,} complete cases over {len(run.outcomes)} of {len(tasks)} tasks, "
        f"{run.seconds:.1f}s on {run.workers} worker(s) ({run.where}): {rate:,.0f} ops/s",
        f"events reached: {len(events)}",
    ]
    for kind, (task, f) in sorted(findings.items()):
        spec = parse_spec(task.args["subject"])
        factory = spec.factory(edits_for(spec, fix=task.args.get("fix"), bug=task.args.get("bug")))
        config = SubjectConfig(**f["config"])
        version = factory(config).version
        name = f"{task.key.replace('/', '-').replace(':', '-')}-c{f['case']}"
        path = directory.findings / f"{name}.jsonl"
        trace.write(path, header_for(spec, version, config, f["case_seed"]), f["ops"])
        lines.append(f"FINDING {kind} in task {task.key}, case {f['case']}: {f['detail']}")
        lines.append(f"  trace: {path} ({len(f['ops'])} ops)")
        sizes = spec.page_sizes((1, 2, 4))
        small, small_config = minimize_finding(
            factory, config, f["ops"], kind, sizes, budget=minimize_budget, max_replays=minimize_replays
        )
        m_path = directory.findings / f"{name}-min.jsonl"
        trace.write(m_path, header_for(spec, version, small_config, None), small)
        extra = "".join(f" --{k} {task.args[k]}" for k in ("fix", "bug") if task.args.get(k))
        lines.append(f"  minimized ({len(small)} ops): {m_path}")
        lines.append(f"  replay it: kvledger replay {m_path}{extra}")
        lines.append(f"  or its task alone: {replay_task_command(task)}")
    return _close(lines, run, tasks, directory, bool(findings), "no finding")


def merge_check(run: CampaignRun, tasks: Sequence[Task], directory: CampaignDir) -> Tuple[str, int]:
    from kvledger.properties.machine import EXPECTED_EVENTS

    done, failures = _finished(run, tasks, "failure")
    sequences = sum(v["sequences"] for _, v in done)
    reached = set().union(*(v["events"] for _, v in done))
    lines = [
        f"{sequences:,} sequences over {len(run.outcomes)} of {len(tasks)} tasks, {run.seconds:.1f}s on "
        f"{run.workers} worker(s) ({run.where}); rare branches reached "
        f"({len(reached & EXPECTED_EVENTS)}/{len(EXPECTED_EVENTS)})"
    ]
    for kind, (task, f) in sorted(failures.items()):
        lines.append(
            f"FAILED ({kind}) in task {task.key} (Hypothesis seed {task.args['hypothesis_seed']}): "
            f"{f['detail'].strip().splitlines()[0]}"
        )
        if f.get("trace"):
            path = directory.findings / f"{task.key.replace('/', '-')}.jsonl"
            path.write_text(f["trace"])
            lines.append(f"  the shrunk failing trace: {path} (kvledger replay it)")
    return _close(lines, run, tasks, directory, bool(failures), "passed")


def fuzz_postfix(outcomes: List[Outcome], seconds: float) -> Dict[str, Any]:
    done = [o.value for o in outcomes if o.status == "done"]
    cases = sum(v.get("cases", 0) for v in done)
    return {
        "cases/s": f"{cases / seconds if seconds else 0:.1f}",
        "findings": sum(v.get("finding") is not None for v in done),
    }


def check_postfix(outcomes: List[Outcome], seconds: float) -> Dict[str, Any]:
    done = [o.value for o in outcomes if o.status == "done"]
    return {
        "sequences": sum(v.get("sequences", 0) for v in done),
        "failures": sum(v.get("failure") is not None for v in done),
    }


def run(
    kind: str,
    options: Dict[str, Any],
    tasks: List[Task],
    executor: Executor,
    directory: CampaignDir,
    merge: Any,
    postfix: Any,
) -> Tuple[str, int]:
    """Run the campaign, merge it, write and return its summary."""
    campaign = run_campaign(kind, options, tasks, executor, directory, postfix=postfix)
    text, code = merge(campaign)
    if campaign.resumed:
        text += f"\n({campaign.resumed} task(s) resumed from {directory.path})"
    directory.write_summary(text)
    return text, (130 if campaign.interrupted and code == 0 else code)
