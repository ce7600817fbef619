"""`python -m kvledger.checker.audit.campaign_bench`: what running a campaign on Ray costs against local worker
processes, on this machine: the per-task overhead (trivial tasks, after one warm-up task per
worker) and the fuzz campaign's cases per second, for 1 and 2 workers each. The same fuzz tasks
are run on both, so their merged findings must agree (checked, and printed)."""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import List, Optional

from kvledger.campaign import CampaignDir, Executor, LocalExecutor, Task, run_campaign

TRIVIAL = "kvledger.checker.audit.campaign_bench:trivial"  # a task that does nothing: the overhead


def _executor(kind: str, workers: int) -> Executor:
    if kind == "local":
        return LocalExecutor(workers)
    from kvledger.campaign.ray_executor import RayExecutor

    return RayExecutor("local", num_cpus=workers)


def _timed(tasks: List[Task], kind: str, workers: int) -> tuple[float, dict]:
    """Seconds for `tasks` after one warm-up task per worker (worker start-up and imports)."""
    executor = _executor(kind, workers)
    close, executor.close = executor.close, lambda: None  # one executor for the warm-up and the run
    try:
        with tempfile.TemporaryDirectory() as d:
            warm = [Task(f"warm/{i}", TRIVIAL, {"x": i}) for i in range(workers)]
            run_campaign("warm", {}, warm, executor, CampaignDir(f"{d}/warm"), progress=False)
            started = time.perf_counter()
            run = run_campaign("timed", {}, tasks, executor, CampaignDir(f"{d}/run"), progress=False)
            return time.perf_counter() - started, run.outcomes
    finally:
        close()


def trivial(x: int) -> dict:
    return {"x": x}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trivial", type=int, default=40, help="trivial tasks per run")
    p.add_argument("--fuzz-tasks", type=int, default=4)
    p.add_argument("--cases", type=int, default=10, help="fuzz cases per task")
    args = p.parse_args(argv)
    from kvledger.checker.campaigns import fuzz_tasks

    trivial_tasks = [Task(f"t/{i}", TRIVIAL, {"x": i}) for i in range(args.trivial)]
    fuzz = fuzz_tasks(seed=1, tasks=args.fuzz_tasks, cases=args.cases, bug=None, admission=None)
    findings = {}
    print(f"{'executor':<8} {'workers':>7} {'per task (ms)':>14} {'fuzz cases/s':>13} {'fuzz ops/s':>11}")
    for workers in (1, 2):
        for kind in ("local", "ray"):
            seconds, _ = _timed(trivial_tasks, kind, workers)
            fuzz_s, outcomes = _timed(fuzz, kind, workers)
            values = [outcomes[t.key].value for t in fuzz]
            cases = sum(v["cases"] for v in values)
            ops = sum(v["ops"] for v in values)
            findings[kind, workers] = [(v["cases"], v["ops"], (v["finding"] or {}).get("kind")) for v in values]
            print(
                f"{kind:<8} {workers:>7} {1000 * seconds / len(trivial_tasks):>14.1f} {cases / fuzz_s:>13.2f} "
                f"{ops / fuzz_s:>11,.0f}"
            )
    same = len({tuple(f) for f in findings.values()}) == 1
    print(
        f"fuzz tasks ({args.fuzz_tasks} x {args.cases} cases, seed 1): the same cases, ops and findings on every "
        f"executor: {'yes' if same else 'NO'}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
