"""Running a campaign's tasks on a Ray cluster (the `cluster` extra: `pip install kvledger[cluster]`).

Ray is what the serving field already runs multi-node (vLLM and SGLang), and its task API is the
shape of a campaign: a remote function per task, `ray.wait` as they end, `ray.cancel` for a task
past its time limit. Faults are handled as `LocalExecutor` handles them (see `executor.py`): Ray
itself retries nothing (`max_retries=0`), so a lost worker is retried once here, where it is
counted. The nodes import kvledger as the driver does: install it on every node of a real cluster.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Deque, Dict, Optional, Sequence, Tuple

from kvledger.campaign.executor import OnOutcome, lost
from kvledger.campaign.task import Outcome, Task

log = logging.getLogger(__name__)

POLL_S = 0.5


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RuntimeError("--cluster needs Ray: pip install 'kvledger[cluster]'") from None
    return ray


def _run_remote(task: Task) -> Tuple[str, Optional[Dict], Optional[str], float]:
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from kvledger.campaign.task import call, failure_text

    started = time.perf_counter()
    try:
        return "done", call(task), None, time.perf_counter() - started
    except Exception:
        return "failed", None, failure_text(), time.perf_counter() - started


class RayExecutor:
    def __init__(self, address: str, num_cpus: Optional[int] = None) -> None:
        ray = _ray()
        self._started_here = not ray.is_initialized()
        if self._started_here:
            local = address == "local"
            ray.init(
                address=None if local else address,
                num_cpus=num_cpus if local else None,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        self.where = f"ray:{address}"
        self.workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self._remote = ray.remote(num_cpus=1, max_retries=0)(_run_remote)

    def run(self, tasks: Sequence[Task], on_outcome: OnOutcome) -> None:
        ray = _ray()
        queue: Deque[Tuple[Task, int]] = deque((t, 1) for t in tasks)
        running: Dict[Any, Tuple[Task, float, int]] = {}  # object ref -> (task, submitted, attempt)
        try:
            while queue or running:
                while queue and len(running) < self.workers:  # submitted when a CPU is free: started
                    task, attempt = queue.popleft()
                    running[self._remote.remote(task)] = (task, time.monotonic(), attempt)
                now = time.monotonic()
                timeout = min([POLL_S] + [max(0.0, s + t.time_limit - now) for t, s, _ in running.values()])
                ready, _ = ray.wait(list(running), num_returns=1, timeout=timeout)
                for ref in ready:
                    task, started, attempt = running.pop(ref)
                    self._collect(ray, ref, task, started, attempt, queue, on_outcome)
                for ref, (task, started, attempt) in list(running.items()):
                    if time.monotonic() - started > task.time_limit:
                        ray.cancel(ref, force=True)
                        del running[ref]
                        on_outcome(Outcome.hung(task, attempt, time.monotonic() - started))
        except KeyboardInterrupt:
            for ref in running:
                ray.cancel(ref, force=True)
            raise

    @staticmethod
    def _collect(
        ray: Any,
        ref: Any,
        task: Task,
        started: float,
        attempt: int,
        queue: Deque[Tuple[Task, int]],
        on_outcome: OnOutcome,
    ) -> None:
        try:
            status, value, error, seconds = ray.get(ref)
        except ray.exceptions.TaskCancelledError:
            return
        except ray.exceptions.RayError as e:  # the worker or its node was lost
            lost(task, attempt, f"its Ray worker was lost ({type(e).__name__})", queue, on_outcome)
            return
        on_outcome(Outcome(task.key, status, value, error, attempt, seconds))

    def close(self) -> None:
        if self._started_here:
            _ray().shutdown()
