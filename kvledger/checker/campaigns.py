"""The checker's campaigns: `kvledger fuzz --tasks N`, `kvledger check --tasks N` (with
`--cluster ADDRESS` to run them on a Ray cluster), each a list of seeded tasks and a merge.

- **fuzz**: task i runs cases 0..cases-1 of the target's fuzz workload (`checker/fuzz.py`: reference
  against fast, or with `--subject` one subject in judge mode), the case seeds its workload derives
  from (seed, i, case), and stops at its first finding. The merge sums the counts, unions the rare
  events reached, and keeps one finding per kind (the first, by task and case), written to the
  campaign directory, minimized once, with the command that replays it.
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
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from kvledger.campaign import CampaignDir, CampaignRun, Executor, Outcome, Task, run_campaign

log = logging.getLogger(__name__)

TASK_LIMIT_S = 1800.0  # a task still running after this long is stopped and reported as hung


def check_seed(seed: int, task: int) -> int:
    digest = hashlib.sha256(f"kvledger-check/{seed}/{task}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


# -- tasks (run in a worker: a local process or a Ray worker) -------------------------------------
def fuzz_shard(
    seed: int,
    shard: int,
    cases: int,
    bug: Optional[str] = None,
    admission: Optional[str] = None,
    subject: Optional[str] = None,
    fix: Optional[str] = None,
    isolation: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Cases 0..cases-1 of fuzz task `shard` under `seed` on the target (`subject` with `fix` and
    `bug`, else reference against fast with fast's zoo bug `bug`); stops at the first finding. The
    cases run in the target's sandbox (`isolation`: an `Isolation`'s fields, None: the kind's
    default): a subject that kills its process ends the task with that finding (its case's trace
    from the write-ahead record), not with a lost worker."""
    import torch

    from kvledger.checker import sandbox
    from kvledger.checker.fuzz_case import as_json
    from kvledger.checker.isolated_runs import died_outcome
    from kvledger.checker.workloads import workload_for
    from kvledger.reference import events

    torch.set_num_threads(1)
    logging.getLogger().setLevel(logging.WARNING)
    target = _recipe(subject, fix, bug, isolation).build()
    workload = workload_for(target, admission)
    counts: Dict[str, int] = {}  # rare event -> the cases that reached it
    first: Dict[str, int] = {}  # rare event -> the case that first reached it
    out: Dict[str, Any] = {"ops": 0, "cases": 0, "preemptions": 0, "optimistic_cases": 0, "finding": None}
    in_flight: List[Tuple[int, int]] = []
    started = time.perf_counter()

    def count(outcome: Any) -> None:
        # as kvledger fuzz counts: a case of a workload that goes on after a finding ends with its failing operation
        out["ops"] += outcome.steps if workload.stops_at_first else len(outcome.ops)
        out["preemptions"] += outcome.preemptions
        for name in outcome.events:
            counts[name] = counts.get(name, 0) + 1
            first.setdefault(name, outcome.number)
        f = outcome.finding
        if f is not None:
            out["finding"] = {
                "kind": f.kind,
                "detail": f.message,
                "traceback": f.detail,
                "step": f.step,
                "case": outcome.number,
                "case_seed": outcome.seed,
                "header": asdict(outcome.header),
                "ops": [as_json(line) for line in outcome.ops],
                "seconds": time.perf_counter() - started,
            }
            return
        out["cases"] += 1
        out["optimistic_cases"] += outcome.header.policy.preempts

    def heard(message: Any) -> None:
        if isinstance(message, tuple):
            in_flight[:] = [message]
        else:
            count(message)

    try:
        with target.active():
            sandbox.call(target.isolation, _shard_cases, workload, seed, shard, cases, on_message=heard)
    except sandbox.SubjectDied as died:
        count(died_outcome(workload, in_flight[0][0], in_flight[0][1], died))
    finally:
        events.set_listener(None)
    out["events"] = counts
    out["first_case"] = first
    out["seconds"] = time.perf_counter() - started
    return out


def _recipe(subject: Optional[str], fix: Optional[str], bug: Optional[str], isolation: Optional[Dict[str, Any]]) -> Any:
    from kvledger.checker.fuzz import TargetRecipe
    from kvledger.properties.isolation import Isolation

    return TargetRecipe(subject, fix, bug, isolation=Isolation(**isolation) if isolation else None)


def _shard_cases(workload: Any, seed: int, shard: int, cases: int) -> None:
    """The task's cases, each announced (number, seed) and then reported (its outcome) through
    `sandbox.send`, up to the first finding."""
    from kvledger.checker.fuzz_case import play_case
    from kvledger.checker.sandbox import send

    for number in range(cases):
        cseed = workload.task_seed(seed, shard, number)
        send((number, cseed))
        outcome = play_case(workload, number, cseed)
        send(outcome)
        if outcome.finding is not None:
            return


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
    seed: int,
    tasks: int,
    cases: int,
    bug: Optional[str],
    admission: Optional[str],
    time_limit: float = TASK_LIMIT_S,
    subject: Optional[str] = None,
    fix: Optional[str] = None,
    isolation: Optional[Dict[str, Any]] = None,
) -> List[Task]:
    """The tasks of a fuzz campaign; `isolation` (an `Isolation`'s fields) only when it is not the
    target's default, so a campaign directory of before it resumes."""
    args: Dict[str, Any] = {"seed": seed, "cases": cases, "bug": bug, "admission": admission}
    prefix = "fuzz"
    if subject is not None:
        args.update(subject=subject, fix=fix)
        prefix = f"fuzz/{subject}"
    if isolation is not None:
        args.update(isolation=isolation)
    return [
        Task(f"{prefix}/seed{seed}/shard{i}", f"{__name__}:fuzz_shard", {**args, "shard": i}, time_limit)
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


Found = Dict[str, Tuple[Task, Dict[str, Any]]]


def _finished(run: CampaignRun, tasks: Sequence[Task], field: str) -> Tuple[List[Tuple[Task, Dict[str, Any]]], Found]:
    """The tasks that returned, with their values, and the first `field` (finding or failure) of
    each kind among them, by task order: kind -> (task, what it found)."""
    done = [(task, o.value or {}) for task, o in _done(run, tasks) if o.status == "done"]
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
    outcomes = _done(run, tasks)
    unfinished = [task for task, o in outcomes if o.status != "done"]
    missing = len(tasks) - len(outcomes)
    if not found and (unfinished or missing):
        lines.append(
            f"INCOMPLETE: no finding in the {len(outcomes) - len(unfinished)} task(s) that finished; "
            f"{len(unfinished)} ended early (below), {missing} never ran"
        )
    elif not found:
        lines.append(clean)
    lines += _task_problems(run, tasks)
    if run.interrupted:
        lines.append(f"interrupted: resume with the same options and --campaign {directory.path}")
    return "\n".join(lines), 1 if found else (2 if unfinished else 0)


def replay_task_command(task: Task) -> str:
    a = task.args
    if task.function.endswith(":fuzz_shard"):
        extra = "".join(f" --{k} {a[k]}" for k in ("subject", "fix", "bug", "admission") if a.get(k))
        return f"kvledger fuzz --tasks 1 --first-task {a['shard']} --cases {a['cases']} --seed {a['seed']}{extra}"
    return f'python -c "from {task.function.split(":")[0]} import *; print({task.function.split(":")[1]}(**{a!r}))"'


def merge_fuzz(
    run: CampaignRun,
    tasks: Sequence[Task],
    directory: CampaignDir,
    minimize_budget: float,
    minimize_replays: Optional[int],
) -> Tuple[str, int]:
    """The merged result and the exit status (1: a finding, 2: a task that did not finish)."""
    from kvledger.checker.fuzz import WorkerFailure, handle_failure
    from kvledger.checker.workloads import workload_for

    totals = {"ops": 0, "cases": 0, "preemptions": 0, "optimistic_cases": 0}
    reached: Set[str] = set()
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
    first_args = tasks[0].args if tasks else {}
    target = _recipe(
        first_args.get("subject"), first_args.get("fix"), first_args.get("bug"), first_args.get("isolation")
    ).build()
    workload = workload_for(target, first_args.get("admission"))
    expected = workload.expected_events()
    if expected:
        lines.append(
            f"rare events reached ({len(reached & expected)}/{len(expected)}); where each was first: corpus.jsonl"
        )
    else:
        lines.append(f"events reached: {len(reached)}; where each was first: corpus.jsonl")
    _write_corpus(directory, corpus)
    if findings:
        workload.prepare()  # a subject's version, for the traces' headers
    for kind, (task, f) in sorted(findings.items()):
        name = f"{task.key.replace('/', '-').replace(':', '-')}-c{f['case']}"
        failure = WorkerFailure(
            task.args["shard"], f["case"], f.get("case_seed", 0), f["header"], f["ops"], kind, f["detail"],
            traceback=f.get("traceback", ""),
        )  # fmt: skip
        paths = (directory.findings / f"{name}.jsonl", directory.findings / f"{name}-min.jsonl")
        found = handle_failure(
            failure,
            target,
            workload,
            directory.findings,
            task.args["seed"],
            minimize_budget,
            False,
            minimize_replays,
            paths=paths,
        )
        after = f", {f['seconds']:.1f}s into its task" if "seconds" in f else ""
        lines.append(
            f"FINDING {kind} in task {task.key}, case {f['case']}{after}: {f['detail'].strip().splitlines()[-1]}"
        )
        lines.append(f"  trace: {found.trace_path} ({len(f['ops'])} ops)")
        if found.minimized_path is not None:
            lines.append(f"  minimized ({found.minimized_ops} ops, {found.minimized_kind}): {found.minimized_path}")
        extra = "".join(f" --{k} {task.args[k]}" for k in ("fix", "bug") if task.args.get(k))
        lines.append(f"  replay it: kvledger replay {found.minimized_path or found.trace_path}{extra}")
        lines.append(f"  or its task alone: {replay_task_command(task)}")
        shown = found.minimized_traceback if found.minimized_path is not None else f.get("traceback", "")
        if shown.strip():
            whose = "the minimized trace's" if found.minimized_path is not None else "the failing run's"
            lines.append(f"  {whose} traceback:\n" + "\n".join("    " + t for t in shown.rstrip().splitlines()))
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
    done = [o.value or {} for o in outcomes if o.status == "done"]
    cases = sum(v.get("cases", 0) for v in done)
    return {
        "cases/s": f"{cases / seconds if seconds else 0:.1f}",
        "findings": sum(v.get("finding") is not None for v in done),
    }


def check_postfix(outcomes: List[Outcome], seconds: float) -> Dict[str, Any]:
    done = [o.value or {} for o in outcomes if o.status == "done"]
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
