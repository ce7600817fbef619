"""Starting and stopping the ranks of a tensor-parallel engine.

`LLM(..., tensor_parallel_size=N)` runs rank 0 in the calling process and spawns ranks 1..N-1
(torch.multiprocessing, "spawn"), which meet through a file rendezvous in a private temporary
directory. Under `torchrun` the ranks already exist: every process runs the same program, rank 0
returns from `LLM(...)` as usual, and the other ranks serve rank 0 inside `LLM(...)` and leave the
process when it shuts down.

Failures: rank 0 watches the ranks it spawned (engine/distributed/rank_watch.py): a rank that raises
sends its traceback and exits, one that is killed ends its process, one that is stopped shows it in
/proc, and one that is frozen stops its heartbeat. The watch then kills and reaps every other rank,
and rank 0's step raises `RankFailed` (the rank's own error) or `RankLost` (how it went): at once
for a rank that ended, within STOPPED_SECONDS for a stopped one and STALL_SECONDS for a frozen one,
also when rank 0 was idle (the engine then has work: reporting it). A spawned rank whose rank 0 is
gone leaves (engine/distributed/heartbeat.py). If rank 0 fails, it kills the others. Under torchrun
on one host rank 0 watches the other ranks' pids for their end and their stop the same way
(engine/distributed/foreign_ranks.py), without a heartbeat; across hosts a dead rank is noticed by
the next collective and a stopped one by the server's step watchdog only (docs/tensor-parallelism.md,
"When a rank is lost").
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, List, NoReturn, Optional

import torch
import torch.multiprocessing as mp

from kvledger.engine.distributed.foreign_ranks import torchrun_peers
from kvledger.engine.distributed.group import TensorParallelGroup
from kvledger.engine.distributed.heartbeat import start_heartbeat
from kvledger.engine.distributed.rank_agreement import RankDisagreement
from kvledger.engine.distributed.rank_errors import RankFailed, RankLost
from kvledger.engine.distributed.rank_watch import RankWatch, kill_and_reap
from kvledger.engine.distributed.replicated_engine import RankHook, serve_rank

__all__ = ["RankFailed", "RankLost", "RankProcesses", "under_torchrun"]

log = logging.getLogger(__name__)

STARTUP_SECONDS = 300.0  # a spawned rank that has not reported in by then is taken for dead
REPORT_GRACE_SECONDS = 2.0  # how long rank 0 waits for the watch to name a peer a collective lost


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "LOCAL_RANK" in os.environ)


class RankProcesses:
    """Rank 0's view of the other ranks: their processes (when spawned) and the watch over them."""

    def __init__(
        self,
        group: TensorParallelGroup,
        procs: List[Any],
        reports: Optional[List[Connection]],
        beats: Any,
        workdir: Optional[str],
    ) -> None:
        self.group = group
        self.procs = procs
        self._workdir = workdir
        self.watch: Optional[RankWatch] = None
        if reports is not None:
            self.watch = RankWatch(procs, reports, beats, self._on_failure, lambda: group.leaving)

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
        beats = ctx.Array("Q", size, lock=False)  # beats[r]: rank r's heartbeat counter
        pipes = [ctx.Pipe(duplex=False) for _ in range(1, size)]
        procs = [
            ctx.Process(
                target=_spawned_rank,
                args=(r, size, options, init, pipes[r - 1][1], beats, os.getpid(), hook),
                daemon=True,
                name=f"kvledger-rank{r}",
            )
            for r in range(1, size)
        ]
        for p in procs:
            p.start()
        reports = [reader for reader, _ in pipes]
        for _, writer in pipes:
            writer.close()  # the child holds its own end: ours would keep the pipe open past its exit
        try:
            _await_started(procs, reports)
            group = TensorParallelGroup.connect(0, size, torch.device(device), init)
        except BaseException:
            kill_and_reap(procs)
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        return cls(group, procs, reports, beats, workdir)

    @classmethod
    def _join_torchrun(cls, options: Any, size: int, hook: Optional[RankHook]) -> RankProcesses:
        from kvledger.engine.runtime.build import build_rank, rank_device

        world, rank, local = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        if world != size:
            raise ValueError(f"tensor_parallel_size is {size} but torchrun started {world} processes")
        device = rank_device(options.device, local, size)
        group = TensorParallelGroup.connect(rank, size, torch.device(device), "env://")
        peers = torchrun_peers(group)  # every rank takes part; rank 0 gets them on one host
        if rank == 0:
            return cls(group, peers or [], None if peers is None else [], None, None)
        engine = build_rank(options, group, device, hook=hook)
        serve_rank(engine.engine, engine.rank_coordination())
        group.close()
        _leave(0)

    # -- failures ------------------------------------------------------------------------------
    @property
    def failure(self) -> Optional[RankFailed]:
        """The first rank that failed or was lost, as rank 0 will raise it; None while all run."""
        return self.watch.failure if self.watch is not None else None

    def _on_failure(self, failure: RankFailed) -> None:
        # the watch's thread, after it killed and reaped the other ranks
        self.group.failure = failure
        if self.group.shard.size > 1 and _uses_nccl():
            self.group.abort()  # NCCL would wait for the dead rank until its timeout

    def explain(self, error: BaseException) -> BaseException:
        """The error to raise for `error`, which ended rank 0's step: the failed or lost rank's
        when a peer went (a collective then breaks on rank 0 with a transport error)."""
        if isinstance(error, (RankDisagreement, RankFailed, KeyboardInterrupt)) or self.watch is None:
            return error
        dead = any(not p.is_alive() for p in self.procs)
        if self.watch.failed.wait(REPORT_GRACE_SECONDS if dead or _is_transport_error(error) else 0.0):
            return self.watch.failure  # type: ignore[return-value]
        return error

    # -- stopping ------------------------------------------------------------------------------
    def close(self, clean: bool) -> None:
        """Join the ranks after a clean shutdown, else kill them; release the group."""
        if self.watch is not None:
            self.watch.stop()  # from here on the ranks leave on purpose
        if clean and self.failure is None:
            deadline = time.monotonic() + 60.0
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
        kill_and_reap(self.procs)
        self.group.close()  # the other ranks are gone: nothing can block
        if self._workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)


def _spawned_rank(
    rank: int,
    size: int,
    options: Any,
    init: str,
    report: Connection,
    beats: Any,
    parent: int,
    hook: Optional[RankHook],
) -> None:
    from kvledger.engine.runtime.build import build_rank, rank_device

    start_heartbeat(beats, rank, parent)
    report.send(("started", ""))
    try:
        device = rank_device(options.device, rank, size)
        group = TensorParallelGroup.connect(rank, size, torch.device(device), init)
        engine = build_rank(options, group, device, hook=hook)
        serve_rank(engine.engine, engine.rank_coordination())
        group.close()
    except BaseException:
        try:
            report.send(("failed", traceback.format_exc()))
        except OSError:  # rank 0 is gone
            pass
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


def _await_started(procs: List[Any], reports: List[Connection]) -> None:
    """Wait until every spawned rank runs our code (an import error would otherwise leave rank 0
    waiting at the rendezvous)."""
    waiting = set(range(1, len(procs) + 1))
    deadline = time.monotonic() + STARTUP_SECONDS
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RankFailed(min(waiting), "did not start")
        wait([reports[r - 1] for r in waiting] + [procs[r - 1].sentinel for r in waiting], timeout=left)
        for rank in sorted(waiting):
            reader, proc = reports[rank - 1], procs[rank - 1]
            if reader.poll():
                try:
                    kind, detail = reader.recv()
                except EOFError:  # it exited before a word
                    raise RankFailed(rank, f"exited with code {proc.exitcode} while starting") from None
                if kind == "failed":
                    raise RankFailed(rank, detail)
                waiting.discard(rank)
            elif proc.exitcode is not None:
                raise RankFailed(rank, f"exited with code {proc.exitcode} while starting")


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
