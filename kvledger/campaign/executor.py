"""Executors: where a campaign's tasks run. `LocalExecutor` runs them in worker processes on this
machine; `RayExecutor` (`ray_executor.py`) on a Ray cluster. Both behave alike on faults:

- a task whose worker dies (killed, out of memory) is retried once on a fresh worker, then
  reported as `died`;
- a task still running at its time limit is stopped and reported as `hung`;
- Ctrl-C stops every task; the outcomes already reported stay reported.

A worker here is a process of its own (spawned, so nothing of the parent's threads or CUDA state
is inherited) that runs one task at a time and lives on between tasks: a task pays the imports
once per worker, not once per task. It is written by hand because `concurrent.futures` gives up
the whole pool when one worker dies, and `multiprocessing.Pool` cannot stop a single hung task.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnContext
from typing import Callable, Deque, List, Optional, Protocol, Sequence, Tuple

from kvledger.campaign.task import MAX_ATTEMPTS, Outcome, Task

log = logging.getLogger(__name__)

OnOutcome = Callable[[Outcome], None]
POLL_S = 0.5


class Executor(Protocol):
    workers: int  # tasks it runs at once
    where: str  # for the summary: "local", or "ray:" and the cluster's address

    def run(self, tasks: Sequence[Task], on_outcome: OnOutcome) -> None:
        """Run every task, reporting each outcome as it ends; on Ctrl-C stop and re-raise."""

    def close(self) -> None: ...


def _worker_main(conn: Connection) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # workers share the cores
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what Ctrl-C stops
    from kvledger.campaign.task import call, failure_text

    while True:
        task = conn.recv()
        if task is None:
            return
        started = time.perf_counter()
        try:
            value = call(task)
        except BaseException:  # noqa: BLE001 (reported to the parent, whatever it was)
            conn.send(("failed", None, failure_text(), time.perf_counter() - started))
        else:
            conn.send(("done", value, None, time.perf_counter() - started))


class _Worker:
    def __init__(self, ctx: SpawnContext) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.process.start()
        child.close()
        self.task: Optional[Tuple[Task, float, int]] = None  # (task, started, attempt)

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class LocalExecutor:
    def __init__(self, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self.where = "local"
        self._ctx = mp.get_context("spawn")
        self._pool: List[_Worker] = []

    def run(self, tasks: Sequence[Task], on_outcome: OnOutcome) -> None:
        queue: Deque[Tuple[Task, int]] = deque((t, 1) for t in tasks)
        while len(self._pool) < min(self.workers, len(tasks)):
            self._pool.append(_Worker(self._ctx))
        try:
            while queue or any(w.task for w in self._pool):
                for w in self._pool:
                    if w.task is None and queue:
                        task, attempt = queue.popleft()
                        w.conn.send(task)
                        w.task = (task, time.monotonic(), attempt)
                self._wait_and_collect(queue, on_outcome)
        except KeyboardInterrupt:
            self.close()
            raise

    def _wait_and_collect(self, queue: Deque[Tuple[Task, int]], on_outcome: OnOutcome) -> None:
        running = [(w, w.task) for w in self._pool if w.task is not None]
        busy = [w for w, _ in running]
        now = time.monotonic()
        timeout = min([POLL_S] + [max(0.0, started + t.time_limit - now) for _, (t, started, _) in running])
        wait([w.conn for w in busy] + [w.process.sentinel for w in busy], timeout=timeout)
        for i, w in enumerate(self._pool):
            if w.task is None:
                continue
            task, started, attempt = w.task
            try:
                answer = w.conn.recv() if w.conn.poll() else None
            except (EOFError, OSError):  # it died before or while sending
                answer = None
            if answer is not None:
                status, value, error, seconds = answer
                w.task = None
                on_outcome(Outcome(task.key, status, value, error, attempt, seconds))
                continue
            if not w.process.is_alive():
                code = w.process.exitcode
                w.stop()
                self._pool[i] = _Worker(self._ctx)
                lost(task, attempt, f"its worker process died (exit code {code})", queue, on_outcome)
            elif time.monotonic() - started > task.time_limit:
                w.stop()
                self._pool[i] = _Worker(self._ctx)
                on_outcome(Outcome.hung(task, attempt, time.monotonic() - started))

    def close(self) -> None:
        for w in self._pool:
            if w.process.is_alive() and w.task is None:
                try:
                    w.conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
            w.stop()
        self._pool = []


def lost(task: Task, attempt: int, why: str, queue: Deque[Tuple[Task, int]], on_outcome: OnOutcome) -> None:
    """A task whose worker was lost: retried once at the front of the queue, then reported."""
    if attempt < MAX_ATTEMPTS:
        log.warning("task %s: %s; retrying it on another worker", task.key, why)
        queue.appendleft((task, attempt + 1))
    else:
        on_outcome(Outcome(task.key, "died", None, f"{why}, on each of {attempt} tries", attempt))


__all__ = ["Executor", "LocalExecutor", "OnOutcome", "lost"]
