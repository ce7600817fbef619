"""Running one campaign: skip what its directory already holds, run the rest on an executor,
record each outcome as it ends, show progress, and hand every outcome to the merge."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from kvledger.campaign.directory import CampaignDir
from kvledger.campaign.executor import Executor
from kvledger.campaign.task import Outcome, Task

log = logging.getLogger(__name__)


@dataclass
class CampaignRun:
    outcomes: Dict[str, Outcome] = field(default_factory=dict)  # every task's, resumed ones included
    resumed: int = 0  # tasks a previous campaign over the directory had finished
    seconds: float = 0.0
    interrupted: bool = False
    workers: int = 0
    where: str = "local"

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes.values())


# what a progress bar shows of the outcomes so far: {"cases/s": ..., "findings": ...}
Postfix = Callable[[List[Outcome], float], Dict[str, Any]]


def run_campaign(
    kind: str,
    options: Dict[str, Any],
    tasks: Sequence[Task],
    executor: Executor,
    directory: CampaignDir,
    postfix: Optional[Postfix] = None,
    progress: Optional[bool] = None,
) -> CampaignRun:
    directory.start(kind, options, tasks)
    keys = {t.key for t in tasks}
    run = CampaignRun(workers=executor.workers, where=executor.where)
    run.outcomes = {k: o for k, o in directory.finished().items() if k in keys}
    run.resumed = len(run.outcomes)
    todo = [t for t in tasks if t.key not in run.outcomes]
    if run.resumed:
        log.info("%s: %d of %d tasks already finished, running %d", directory.path, run.resumed, len(tasks), len(todo))
    bar = _bar(len(tasks), run.resumed, kind, progress)
    new: List[Outcome] = []
    started = time.monotonic()

    def on_outcome(outcome: Outcome) -> None:
        directory.record(outcome)
        run.outcomes[outcome.key] = outcome
        new.append(outcome)
        if outcome.status != "done":
            log.warning("task %s %s: %s", outcome.key, outcome.status, (outcome.error or "").strip().splitlines()[-1:])
        if bar is not None:
            bar.update(1)
            if postfix is not None:
                bar.set_postfix(postfix(new, time.monotonic() - started), refresh=False)

    try:
        if todo:
            executor.run(todo, on_outcome)
    except KeyboardInterrupt:
        run.interrupted = True
        log.warning(
            "interrupted: %d of %d tasks finished; the rest stopped (resume with the same --campaign)",
            len(run.outcomes),
            len(tasks),
        )
    finally:
        run.seconds = time.monotonic() - started
        if bar is not None:
            bar.close()
        executor.close()
    return run


def _bar(total: int, done: int, kind: str, enabled: Optional[bool]) -> Any:
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc=f"{kind} campaign", unit="task", file=sys.stderr)
