"""Starting and stopping the ranks of a tensor-parallel engine.

`LLM(..., tensor_parallel_size=N)` runs rank 0 in the calling process and spawns ranks 1..N-1
(torch.multiprocessing, "spawn"), which meet through a file rendezvous in a private temporary
directory. Under `torchrun` the ranks already exist: every process runs the same program, rank 0
returns from `LLM(...)` as usual, and the other ranks serve rank 0 inside `LLM(...)` and leave the
process when it shuts down.

Failures: a spawned rank that raises reports its traceback to rank 0 and exits; its peers' next
collective then fails (gloo sees the socket close; on NCCL rank 0 aborts its communicators), and
rank 0 raises `RankFailed` with that rank's error. If rank 0 fails, it terminates the others.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, List, NoReturn, Optional, Tuple

import torch
import torch.multiprocessing as mp

from kvledger.engine.distributed.group import TensorParallelGroup
from kvledger.engine.distributed.rank_agreement import RankDisagreement
from kvledger.engine.distributed.replicated_engine import RankHook, serve_rank

log = logging.getLogger(__name__)

STARTUP_SECONDS = 300.0  # a spawned rank that has not reported in by then is taken for dead
REPORT_GRACE_SECONDS = 10.0  # how long rank 0 waits for a failed peer's traceback


class RankFailed(RuntimeError):
    def __init__(self, rank: int, detail: str) -> None:
        lines = [line for line in detail.strip().splitlines() if line.strip()]
        summary = lines[-1] if lines else "no detail"  # the exception's own line ends a traceback
        super().__init__(f"tensor-parallel rank {rank} failed: {summary}\n{detail}")
        self.rank, self.detail = rank, detail


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "LOCAL_RANK" in os.environ)


class RankProcesses:
    """Rank 0's view of the other ranks: their processes (when spawned) and their failure reports."""

    def __init__(self, group: TensorParallelGroup, procs: List[Any], reports: Any, workdir: Optional[str]) -> None:
        self.group = group
        self.procs = procs
        self._reports = reports
        self._workdir = workdir
        self._failure: Optional[Tuple[int, str]] = None
        self._failed = threading.Event()
        self._watch: Optional[threading.Thread] = None
        if reports is not None:
            self._watch = threading.Thread(target=self._watch_reports, name="kvledger-tp-watch", daemon=True)
            self._watch.start()

    # -- starting ------------------------------------------------------------------------------
    @classmethod
    def start(cls, options: Any, device: str, hook: Optional[RankHook] = None) -> RankProcesses:
        """Spawn ranks 1..N-1 (or join torchrun's world) and connect rank 0. On a torchrun rank
        other than 0 this serves rank 0 and then exits the process."""
        size = options.tensor_parallel_size
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError(
                "a tensor-parallel engine (or another torch.distributed user) is already running in "
                "this process: close() that LLM first"
            )
        if under_torchrun():
            return cls._join_torchrun(options, size, hook)
        workdir = tempfile.mkdtemp(prefix="kvledger-tp-")
        init = f"file://{os.path.join(workdir, 'rendezvous')}"
        ctx = mp.get_context("spawn")
        reports = ctx.SimpleQueue()
        procs = [
            ctx.Process(
                target=_spawned_rank,
                args=(r, size, options, init, reports, hook),
                daemon=True,
                name=f"kvledger-rank{r}",
            )
            for r in range(1, size)
        ]
        for p in procs:
            p.start()
        try:
            _await_started(procs, reports)
            group = TensorParallelGroup.connect(0, size, torch.device(device), init)
        except BaseException:
            _terminate(procs)
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        return cls(group, procs, reports, workdir)

    @classmethod
    def _join_torchrun(cls, options: Any, size: int, hook: Optional[RankHook]) -> RankProcesses:
        from kvledger.engine.runtime.build import build_rank, rank_device

        world, rank, local = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        if world != size:
            raise ValueError(f"tensor_parallel_size is {size} but torchrun started {world} processes")
        device = rank_device(options.device, local, size)
        group = TensorParallelGroup.connect(rank, size, torch.device(device), "env://")
        if rank == 0:
            return cls(group, [], None, None)
        engine = build_rank(options, group, device, hook=hook)
        serve_rank(engine.engine, engine.rank_coordination())
        group.close()
        _leave(0)

    # -- failures ------------------------------------------------------------------------------
    def _watch_reports(self) -> None:
        while True:
            kind, rank, detail = self._reports.get()
            if kind == "closed":
                return
            if kind == "failed" and self._failure is None:
                self._failure = (rank, detail)
                self._failed.set()
                if self.group.shard.size > 1 and _uses_nccl():
                    self.group.abort()  # NCCL would wait for the dead rank until its timeout

    def explain(self, error: BaseException) -> BaseException:
        """The error to raise for `error`, which ended rank 0's step: the failed rank's own error
        when a peer failed (a collective then breaks on rank 0 with a transport error)."""
        if isinstance(error, (RankDisagreement, KeyboardInterrupt)) or self._reports is None:
            return error
        dead = any(not p.is_alive() for p in self.procs)
        if self._failed.wait(REPORT_GRACE_SECONDS if dead or _is_transport_error(error) else 0.0):
            rank, detail = self._failure  # type: ignore[misc]
            return RankFailed(rank, detail)
        return error

    # -- stopping ------------------------------------------------------------------------------
    def close(self, clean: bool) -> None:
        """Join the ranks after a clean shutdown, else terminate them; release the group."""
        if clean:
            deadline = time.monotonic() + 60.0
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
        _terminate(self.procs)
        if self._reports is not None:
            self._reports.put(("closed", 0, ""))
        self.group.close()  # the other ranks are gone: nothing can block
        if self._workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)


def _spawned_rank(rank: int, size: int, options: Any, init: str, reports: Any, hook: Optional[RankHook]) -> None:
    from kvledger.engine.runtime.build import build_rank, rank_device

    reports.put(("started", rank, ""))
    try:
        device = rank_device(options.device, rank, size)
        group = TensorParallelGroup.connect(rank, size, torch.device(device), init)
        engine = build_rank(options, group, device, hook=hook)
        serve_rank(engine.engine, engine.rank_coordination())
        group.close()
    except BaseException:
        reports.put(("failed", rank, traceback.format_exc()))
        os._exit(1)  # no interpreter teardown: the process group's sockets close now, peers notice
    _leave(0)


def _leave(code: int) -> NoReturn:
    """End a rank other than 0 once its work is done and its group closed, without interpreter
    teardown. The process group's native threads can still be running when the interpreter's
    destructors run, and a C++ thread destroyed while running aborts the process (SIGABRT,
    "terminate called without an active exception"): torchrun then reports the run failed, as one
    CI run of tests/engine/distributed/test_tensor_parallel.py saw."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or a broken pipe: nothing more to deliver
            pass
    os._exit(code)


def _await_started(procs: List[Any], reports: Any) -> None:
    """Wait until every spawned rank runs our code (an import error would otherwise leave rank 0
    waiting at the rendezvous)."""
    started: set = set()
    deadline = time.monotonic() + STARTUP_SECONDS
    while len(started) < len(procs):
        if not reports.empty():
            kind, rank, detail = reports.get()
            if kind == "failed":
                raise RankFailed(rank, detail)
            started.add(rank)
            continue
        dead = [p for p in procs if p.exitcode is not None]
        if dead:
            raise RankFailed(procs.index(dead[0]) + 1, f"exited with code {dead[0].exitcode} while starting")
        if time.monotonic() > deadline:
            raise RankFailed(min(set(range(1, len(procs) + 1)) - started), "did not start")
        time.sleep(0.01)


def _terminate(procs: List[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(10.0)
        if p.is_alive():
            p.kill()


def _uses_nccl() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_backend() == "nccl"


def _is_transport_error(error: BaseException) -> bool:
    """A collective that broke (a peer gone), as opposed to rank 0's own failure."""
    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    return isinstance(error, RuntimeError) and any(k in str(error) for k in ("gloo", "NCCL", "Connection closed"))
