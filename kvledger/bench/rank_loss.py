"""Lose a tensor-parallel rank under load and time what the server does, from outside.

    python -m kvledger.bench.rank_loss                      # kill, then stop, rank 1 of `serve --tp 2`
    python -m kvledger.bench.rank_loss --loss stop --clients 48
    python -m kvledger.bench.rank_loss --via inject         # the fault facility: rank-kill@step=N,rank=1

Starts `kvledger serve --tp 2` on the embedded model (CPU, gloo), opens `--clients` concurrent
streaming completions, and once every one of them has streamed a token, loses rank 1: SIGKILL or
SIGSTOP sent to its process from here (`--via signal`), or `KVLEDGER_INJECT_FAULT` set so rank 1
kills or stops itself at the step where the load is running (`--via inject`). It then prints, in
seconds from the loss: when /health first stopped answering 200 (and what it answered), when the
first and the last stream ended with an error event, when the server's process exited and with
which status, and every process of the server's tree still alive afterwards (an orphan).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import httpx
import psutil

from kvledger.engine.server.launch import ServerProcess

SERVER_ARGS = ["--tp", "2", "--threads", "1", "--max-seq-len", "1024", "--log-level", "warning"]
PROMPT = "Write a long story about a lighthouse keeper and the sea."
EXIT_WAIT_S = 60.0  # how long the script waits for the server to exit before it counts a hang
INJECT_AT_STEP = 8  # --via inject: after prefill, while every client streams


@dataclass
class Outcome:
    loss: str
    via: str
    clients: int
    streams_errored: int = 0
    streams_finished: int = 0  # ended normally: the loss came too late for them
    streams_cut: int = 0  # ended without an error event or a finish: a reset connection or a hang
    first_error_s: Optional[float] = None
    all_errored_s: Optional[float] = None
    health_not_ok_s: Optional[float] = None
    health_answers: List[Tuple[float, int, str]] = field(default_factory=list)
    exit_s: Optional[float] = None
    exit_code: Optional[int] = None
    orphans: List[str] = field(default_factory=list)
    error_sample: str = ""
    log_lines: List[str] = field(default_factory=list)


class Clients:
    """`n` streaming completions; `streaming` is set once each has streamed a token."""

    def __init__(self, url: str, model: str, n: int, max_tokens: int) -> None:
        self.url, self.model, self.n, self.max_tokens = url, model, n, max_tokens
        self.started = 0
        self.streaming = asyncio.Event()
        self.loss_at: Optional[float] = None
        self.ends: List[Tuple[str, float, str]] = []  # ("error" | "finish" | "cut", time, detail)

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=self.n + 8)
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
            await asyncio.gather(*(self._one(client, i) for i in range(self.n)))

    async def _one(self, client: httpx.AsyncClient, i: int) -> None:
        body = {
            "model": self.model,
            "prompt": f"{PROMPT} ({i})",
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        first = True
        try:
            async with client.stream("POST", f"{self.url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    self.ends.append(("error", time.monotonic(), f"status {resp.status_code}"))
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        self.ends.append(("finish", time.monotonic(), ""))
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        self.ends.append(("error", time.monotonic(), json.dumps(chunk["error"])))
                        return
                    if first:
                        first = False
                        self.started += 1
                        if self.started == self.n:
                            self.streaming.set()
            self.ends.append(("cut", time.monotonic(), "the stream ended without [DONE] or an error"))
        except httpx.HTTPError as e:
            self.ends.append(("cut", time.monotonic(), f"{type(e).__name__}: {e}"))
        finally:
            if first:  # it ended before it streamed: nothing to wait for (reported as it ended)
                self.started += 1
                if self.started == self.n:
                    self.streaming.set()


def _tree(pid: int) -> List[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _rank_process(server_pid: int) -> psutil.Process:
    ranks = [p for p in _tree(server_pid) if "spawn_main" in " ".join(p.cmdline())]
    if len(ranks) != 1:
        raise RuntimeError(f"expected one spawned rank under the server, found {[p.pid for p in ranks]}")
    return ranks[0]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone_or_stopped(p: psutil.Process) -> bool:
    try:
        return not _alive(p) or p.status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        return True


def _watch_health(url: str, out: Outcome, t0: List[float], stop: threading.Event) -> None:
    """Poll /health every 50 ms until the server stops answering; keep each change of answer."""
    last: Optional[Tuple[int, str]] = None
    with httpx.Client(timeout=2.0) as client:
        while not stop.is_set():
            try:
                r = client.get(f"{url}/health")
                answer = (r.status_code, r.text)
            except httpx.HTTPError as e:
                answer = (0, type(e).__name__)
            if t0 and answer != last:
                at = time.monotonic() - t0[0]
                out.health_answers.append((at, *answer))
                if answer[0] != 200 and out.health_not_ok_s is None:
                    out.health_not_ok_s = at
            last = answer
            if t0 and answer[0] == 0:
                return  # nobody answers any more
            time.sleep(0.05)


async def _lose_rank(
    loss: str, via: str, clients: int, max_tokens: int, server: ServerProcess, out: Outcome
) -> Tuple[float, List[psutil.Process]]:
    assert server.proc is not None
    tree = _tree(server.proc.pid)
    rank = _rank_process(server.proc.pid)
    model = httpx.get(f"{server.url}/v1/models", timeout=10.0).json()["data"][0]["id"]
    load = Clients(server.url, model, clients, max_tokens)
    t0: List[float] = []
    stop_health = threading.Event()
    health = threading.Thread(target=_watch_health, args=(server.url, out, t0, stop_health), daemon=True)
    health.start()
    running = asyncio.create_task(load.run())
    if via == "signal":
        await asyncio.wait_for(load.streaming.wait(), 300.0)
        t0.append(time.monotonic())
        os.kill(rank.pid, signal.SIGKILL if loss == "kill" else signal.SIGSTOP)
    else:  # the rank takes itself out at INJECT_AT_STEP; the loss is when its state changes
        while not _gone_or_stopped(rank):
            await asyncio.sleep(0.005)
        t0.append(time.monotonic())
    await running
    stop_health.set()
    health.join(5.0)
    for kind, _, detail in load.ends:
        if kind == "error":
            out.streams_errored += 1
            out.error_sample = out.error_sample or detail
        elif kind == "finish":
            out.streams_finished += 1
        else:
            out.streams_cut += 1
            out.error_sample = out.error_sample or detail
    errors = sorted(at - t0[0] for kind, at, _ in load.ends if kind == "error")
    if errors:
        out.first_error_s, out.all_errored_s = errors[0], errors[-1]
    return t0[0], tree


def run_once(loss: str, via: str, clients: int, max_tokens: int) -> Outcome:
    out = Outcome(loss, via, clients)
    env_before = os.environ.get("KVLEDGER_INJECT_FAULT")
    if via == "inject":
        os.environ["KVLEDGER_INJECT_FAULT"] = f"rank-{loss}@step={INJECT_AT_STEP},rank=1"
    server = ServerProcess(SERVER_ARGS, startup_timeout=300.0)
    try:
        server.start()
    finally:
        if env_before is None:
            os.environ.pop("KVLEDGER_INJECT_FAULT", None)
        else:
            os.environ["KVLEDGER_INJECT_FAULT"] = env_before
    try:
        proc = server.proc
        assert proc is not None
        exited: List[float] = []
        waiter = threading.Thread(target=lambda: (proc.wait(), exited.append(time.monotonic())), daemon=True)
        waiter.start()
        t0, tree = asyncio.run(_lose_rank(loss, via, clients, max_tokens, server, out))
        waiter.join(max(0.0, EXIT_WAIT_S - (time.monotonic() - t0)))
        if exited:
            out.exit_code, out.exit_s = proc.returncode, exited[0] - t0
        time.sleep(0.5)  # let the kernel reap what the server's exit left
        out.orphans = [f"{p.pid} {' '.join(p.cmdline())[:80]}" for p in tree if _alive(p)]
        out.log_lines = [line for line in server.log(tail=None).splitlines() if "lost" in line or "fault" in line]
    finally:
        for p in _tree(server.proc.pid if server.proc else 0):
            p.kill()
        server.stop()
    return out


def report(out: Outcome) -> str:
    def s(x: Optional[float]) -> str:
        return "never" if x is None else f"{x:.2f} s"

    lines = [
        f"rank 1 {'killed (SIGKILL)' if out.loss == 'kill' else 'stopped (SIGSTOP)'} via {out.via}, "
        f"{out.clients} streaming clients",
        f"  /health not 200 after  {s(out.health_not_ok_s)}",
        f"  first stream errored   {s(out.first_error_s)}",
        f"  all streams errored    {s(out.all_errored_s)}  ({out.streams_errored} errored, "
        f"{out.streams_finished} finished, {out.streams_cut} cut)",
        f"  process exited after   {s(out.exit_s)}  (status {out.exit_code})",
        f"  orphans left           {len(out.orphans)} {out.orphans if out.orphans else ''}".rstrip(),
        "  /health answered       "
        + "; ".join(f"{at:.2f} s: {code or 'no answer'} {text[:110]}" for at, code, text in out.health_answers),
        f"  a stream's error       {out.error_sample[:200]}",
    ]
    lines += [f"  log: {line[:200]}" for line in out.log_lines[:4]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvledger.bench.rank_loss", description=__doc__.split("\n\n")[0])
    p.add_argument("--loss", choices=["kill", "stop", "both"], default="both")
    p.add_argument("--via", choices=["signal", "inject"], default="signal")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args(argv)
    outcomes: Dict[str, Any] = {}
    worst = 0
    for loss in ("kill", "stop") if args.loss == "both" else (args.loss,):
        out = run_once(loss, args.via, args.clients, args.max_tokens)
        print(report(out), flush=True)
        outcomes[loss] = out
        ok = (
            out.streams_errored == args.clients
            and out.exit_code not in (None, 0)
            and out.exit_s is not None
            and out.exit_s <= 5.0
            and not out.orphans
        )
        worst = max(worst, 0 if ok else 1)
    return worst


if __name__ == "__main__":
    sys.exit(main())
