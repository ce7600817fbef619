"""Lose a tensor-parallel rank under load and time what the server does, from outside.

    python -m kvledger.bench.rank_loss                      # kill, then stop, rank 1 of `serve --tp 2`
    python -m kvledger.bench.rank_loss --loss stop --clients 48
    python -m kvledger.bench.rank_loss --via inject         # the fault facility: rank-kill@step=N,rank=1

Starts `kvledger serve --tp 2` on the embedded model (CPU, gloo), opens `--clients` concurrent
streaming completions and `--non-stream` plain ones, and once every stream has a token, loses
rank 1: SIGKILL or SIGSTOP sent to its process from here (`--via signal`), or
`KVLEDGER_INJECT_FAULT` set so that rank 1 kills or stops itself at step `--step` (`--via inject`;
the loss is then when this script sees the process end or stop). It prints, in seconds from the
loss: when the server logged the loss (its detection), when /health first stopped answering 200 and
everything it answered, when the first and the last request ended with an error, when the server's
process exited and with which status, and every process of the server's tree still alive after it
(an orphan). The exit status is 0 when every request ended with an error, the server exited
non-zero within 5 s and no orphan was left.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import httpx

from kvledger.engine.server.launch import ServerProcess

SERVER_ARGS = ["--tp", "2", "--threads", "1", "--max-seq-len", "1024", "--log-level", "warning"]
PROMPT = "Write a long story about a lighthouse keeper and the sea."
EXIT_WAIT_S = 60.0  # how long the script waits for the server to exit before it counts a hang
EXIT_WITHIN_S = 5.0  # what the server promises
LOSS_LOG = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*rank \d+ lost")


@dataclass
class End:
    stream: bool
    kind: str  # "error": an error event or an error body; "finish": completed; "cut": neither
    at: float  # time.monotonic()
    detail: str


@dataclass
class Outcome:
    loss: str
    via: str
    clients: int
    non_stream: int
    ends: List[End] = field(default_factory=list)
    t0: float = 0.0  # the loss, time.monotonic()
    detected_s: Optional[float] = None  # the server's log line naming the lost rank
    health_answers: List[Tuple[float, int, str]] = field(default_factory=list)
    exit_s: Optional[float] = None
    exit_code: Optional[int] = None
    orphans: List[str] = field(default_factory=list)
    log_lines: List[str] = field(default_factory=list)

    def count(self, stream: bool, kind: str) -> int:
        return sum(e.stream == stream and e.kind == kind for e in self.ends)

    @property
    def health_not_ok_s(self) -> Optional[float]:
        return next((at for at, code, _ in self.health_answers if code != 200 and at >= 0), None)

    @property
    def ok(self) -> bool:
        errored = self.count(True, "error") + self.count(False, "error")
        return (
            errored == self.clients + self.non_stream
            and self.exit_code not in (None, 0)
            and self.exit_s is not None
            and self.exit_s <= EXIT_WITHIN_S
            and not self.orphans
        )


class Clients:
    """`streams` streaming completions and `plain` non-streaming ones; `streaming` is set once
    every stream has a token (or has ended)."""

    def __init__(self, url: str, model: str, streams: int, plain: int, max_tokens: int) -> None:
        self.url, self.model, self.streams, self.plain, self.max_tokens = url, model, streams, plain, max_tokens
        self.started = 0
        self.streaming = asyncio.Event()
        self.ends: List[End] = []

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=self.streams + self.plain + 8)
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
            await asyncio.gather(
                *(self._stream(client, i) for i in range(self.streams)),
                *(self._plain(client, self.streams + i) for i in range(self.plain)),
            )

    def _body(self, i: int, stream: bool) -> dict:
        prompt = f"{PROMPT} ({i})"
        return {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": stream}  # fmt: skip

    def _end(self, stream: bool, kind: str, detail: str) -> None:
        self.ends.append(End(stream, kind, time.monotonic(), detail))

    async def _plain(self, client: httpx.AsyncClient, i: int) -> None:
        try:
            resp = await client.post(f"{self.url}/v1/completions", json=self._body(i, False))
        except httpx.HTTPError as e:
            return self._end(False, "cut", f"{type(e).__name__}: {e}")
        if resp.status_code == 200:
            return self._end(False, "finish", "")
        try:
            error = resp.json()["error"]
        except (ValueError, KeyError, TypeError):
            return self._end(False, "cut", f"status {resp.status_code} without an OpenAI error body")
        self._end(False, "error", f"status {resp.status_code}: {json.dumps(error)}")

    async def _stream(self, client: httpx.AsyncClient, i: int) -> None:
        first = True
        try:
            async with client.stream("POST", f"{self.url}/v1/completions", json=self._body(i, True)) as resp:
                if resp.status_code != 200:
                    return self._end(True, "error", f"status {resp.status_code}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        return self._end(True, "finish", "")
                    chunk = json.loads(data)
                    if "error" in chunk:
                        return self._end(True, "error", f"error event: {json.dumps(chunk['error'])}")
                    if first:
                        first = False
                        self._started()
            self._end(True, "cut", "the stream ended without [DONE] or an error event")
        except httpx.HTTPError as e:
            self._end(True, "cut", f"{type(e).__name__}: {e}")
        finally:
            if first:  # it ended before it streamed: nothing to wait for
                self._started()

    def _started(self) -> None:
        self.started += 1
        if self.started == self.streams:
            self.streaming.set()


# -- the server's processes ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Proc:
    """A process, by pid and start time (so a reused pid is not taken for it)."""

    pid: int
    started: str

    def stat(self) -> Optional[List[str]]:
        fields = _stat(self.pid)
        return fields if fields is not None and fields[19] == self.started else None

    def state(self) -> Optional[str]:
        """R, S, T, Z, ...; None once it is gone and reaped."""
        fields = self.stat()
        return fields[0] if fields else None

    def cmdline(self) -> str:
        try:
            with open(f"/proc/{self.pid}/cmdline", "rb") as f:
                return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            return ""


def _stat(pid: int) -> Optional[List[str]]:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...; [19] is the start
    time); None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def _tree(pid: int) -> List[Proc]:
    """Every descendant of process `pid`, from /proc."""
    parents: Dict[int, Tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None:
                parents[int(entry)] = (int(fields[1]), fields[19])
    out: List[Proc] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, started) in parents.items():
            if ppid == parent:
                out.append(Proc(child, started))
                frontier.append(child)
    return out


def _rank_process(server_pid: int) -> Proc:
    ranks = [p for p in _tree(server_pid) if "spawn_main" in p.cmdline()]
    if len(ranks) != 1:
        raise RuntimeError(f"expected one spawned rank under the server, found {[p.pid for p in ranks]}")
    return ranks[0]


def _alive(p: Proc) -> bool:
    return p.state() not in (None, "Z")


def _gone_or_stopped(p: Proc) -> bool:
    return p.state() in (None, "Z", "T")


class HealthWatch:
    """Polls /health every 20 ms until nobody answers (or `stop`); keeps each change of answer, in
    seconds from `t0` once it is set."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.t0: Optional[float] = None
        self.answers: List[Tuple[float, int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        last: Optional[Tuple[int, str]] = None
        with httpx.Client(timeout=2.0) as client:
            while not self._stop.is_set():
                try:
                    r = client.get(f"{self.url}/health")
                    answer = (r.status_code, r.text)
                except httpx.HTTPError as e:
                    answer = (0, type(e).__name__)
                if self.t0 is not None and answer != last:
                    self.answers.append((time.monotonic() - self.t0, *answer))
                last = answer
                if self.t0 is not None and answer[0] == 0:
                    return  # nobody answers any more
                time.sleep(0.02)


# -- one run ------------------------------------------------------------------------------------------
async def _load_and_lose(
    server: ServerProcess, out: Outcome, max_tokens: int, health: HealthWatch
) -> Tuple[float, float]:
    """Run the load, lose rank 1 in the middle; (the loss's time.monotonic(), its time.time())."""
    assert server.proc is not None
    rank = _rank_process(server.proc.pid)
    model = httpx.get(f"{server.url}/v1/models", timeout=10.0).json()["data"][0]["id"]
    load = Clients(server.url, model, out.clients, out.non_stream, max_tokens)
    running = asyncio.create_task(load.run())
    if out.via == "signal":
        await asyncio.wait_for(load.streaming.wait(), 300.0)
        os.kill(rank.pid, signal.SIGKILL if out.loss == "kill" else signal.SIGSTOP)
    else:  # rank 1 takes itself out at its step: the loss is when its process ends or stops
        while not _gone_or_stopped(rank) and not running.done():
            await asyncio.sleep(0.005)
    t0, wall = time.monotonic(), time.time()
    health.t0 = t0
    await running
    out.ends = load.ends
    return t0, wall


def run_once(loss: str, via: str, clients: int, non_stream: int, max_tokens: int, step: int) -> Outcome:
    out = Outcome(loss, via, clients, non_stream)
    env = {"KVLEDGER_INJECT_FAULT": f"rank-{loss}@step={step},rank=1"} if via == "inject" else {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    server = ServerProcess(SERVER_ARGS, startup_timeout=300.0)
    try:
        server.start()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    proc = server.proc
    assert proc is not None
    tree = _tree(proc.pid)
    try:
        exited: List[float] = []

        def wait_for_exit() -> None:
            proc.wait()
            exited.append(time.monotonic())

        waiter = threading.Thread(target=wait_for_exit, daemon=True)
        waiter.start()
        health = HealthWatch(server.url)
        t0, wall = asyncio.run(_load_and_lose(server, out, max_tokens, health))
        out.t0 = t0
        waiter.join(max(0.0, EXIT_WAIT_S - (time.monotonic() - t0)))
        health.stop()
        out.health_answers = health.answers
        if exited:
            out.exit_code, out.exit_s = proc.returncode, exited[0] - t0
        time.sleep(0.5)  # what the server's exit left has been reaped by now, or is an orphan
        out.orphans = [f"{p.pid} {p.cmdline()[:80]}" for p in tree if _alive(p)]
        log = server.log(tail=None).splitlines()
        out.log_lines = [line for line in log if " lost" in line or "engine fault" in line]
        out.detected_s = _detected(log, wall)
    finally:
        for p in tree:  # nothing is left behind by the script either
            if _alive(p):
                os.kill(p.pid, signal.SIGKILL)
        server.stop()
    return out


def _detected(log: List[str], wall: float) -> Optional[float]:
    for line in log:
        m = LOSS_LOG.match(line)
        if m:
            at = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            return at - wall
    return None


def report(out: Outcome) -> str:
    def s(x: Optional[float]) -> str:
        return "never" if x is None else f"{x:.2f} s"

    errors = sorted(e.at - out.t0 for e in out.ends if e.kind == "error")
    first_error, all_errored = (errors[0], errors[-1]) if errors else (None, None)
    sample = next((e.detail for e in out.ends if e.kind != "finish" and e.stream), "")
    plain = next((e.detail for e in out.ends if e.kind != "finish" and not e.stream), "")
    lines = [
        f"rank 1 {'killed (SIGKILL)' if out.loss == 'kill' else 'stopped (SIGSTOP)'} via {out.via}; "
        f"{out.clients} streaming and {out.non_stream} non-streaming clients",
        f"  loss detected (log)    {s(out.detected_s)}",
        f"  /health not 200 after  {s(out.health_not_ok_s)}",
        f"  first request errored  {s(first_error)}",
        f"  all requests errored   {s(all_errored)}  (streams: {out.count(True, 'error')} errored, "
        f"{out.count(True, 'finish')} finished, {out.count(True, 'cut')} cut; non-streaming: "
        f"{out.count(False, 'error')} errored, {out.count(False, 'finish')} finished, {out.count(False, 'cut')} cut)",
        f"  process exited after   {s(out.exit_s)}  (status {out.exit_code})",
        f"  orphans left           {len(out.orphans)} {out.orphans if out.orphans else ''}".rstrip(),
        "  /health answered       "
        + "; ".join(f"{at:.2f} s: {code or 'no answer'} {text[:110]}" for at, code, text in out.health_answers),
        f"  a stream's end         {sample[:200]}",
        f"  a plain request's end  {plain[:200]}",
        f"  verdict                {'ok' if out.ok else 'NOT OK'}",
    ]
    lines += [f"  log: {line[:200]}" for line in out.log_lines[:3]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvledger.bench.rank_loss", description=__doc__.split("\n\n")[0])
    p.add_argument("--loss", choices=["kill", "stop", "both"], default="both")
    p.add_argument("--via", choices=["signal", "inject"], default="signal")
    p.add_argument("--clients", type=int, default=32, help="streaming clients")
    p.add_argument("--non-stream", type=int, default=4, help="non-streaming clients besides")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--step", type=int, default=8, help="--via inject: the step rank 1 goes at")
    args = p.parse_args(argv)
    worst = 0
    for loss in ("kill", "stop") if args.loss == "both" else (args.loss,):
        out = run_once(loss, args.via, args.clients, args.non_stream, args.max_tokens, args.step)
        print(report(out), flush=True)
        worst = max(worst, 0 if out.ok else 1)
    return worst


if __name__ == "__main__":
    sys.exit(main())
