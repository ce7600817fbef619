"""Inject each fault kind into a real server under concurrent streaming clients, and report what happened.

    python -m kvledger.bench.faults                       # every kind, 32 clients, the embedded model
    python -m kvledger.bench.faults --kinds forward-raise --clients 8

For each kind it starts `kvledger serve --verify` on the embedded model with `--inject-fault SPEC`,
and opens `--clients` streaming completions (greedy, EOS ignored) in two waves: the first half,
then, once every one of those has streamed a token, the second half. Each fault names a request of
the second wave (`request=UID`), so it strikes the step that first holds it: the prefill admitting
it (forward-raise: that whole batch; alloc-refuse: that request alone), or there the engine dies
(cuda-poison, and step-stall, which the watchdog declares after `--step-timeout`). The same load on
a server without a fault gives the reference outputs.

It prints per kind: the requests that ended with an error event and those that finished, how many
of the finished ones equal the fault-free run, and then, for a fault the engine contains, /health,
the idle integrity check (pages leaked, locked tokens), the cache operations --verify mirrored
against those performed, and whether a request after the fault is served; for one it cannot
contain, /health while dying and the process's exit status and time, in seconds from the first
error event a client read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import httpx

from kvledger.engine.server.launch import ServerProcess

CONTAINED = ("forward-raise", "alloc-refuse")
KINDS = ("forward-raise", "alloc-refuse", "step-stall", "cuda-poison")
TARGET_OFFSET = 4  # the fault names the 5th request of the second wave
SERVER_ARGS = ["--verify", "--max-seq-len", "256", "--kv-cache-tokens", "8192", "--log-level", "warning"]
EXIT_WAIT_S = 60.0  # how long to wait for a dying server's exit before counting a hang
STEP_TIMEOUT_S = 3.0  # the watchdog's limit in the step-stall run


def spec_for(kind: str, clients: int) -> str:
    """The fault of a run: it strikes the first step holding a request of the second wave."""
    target = clients // 2 + min(TARGET_OFFSET, clients - clients // 2 - 1)
    return f"{kind}@step=1,request={target}"


def prompt_ids(i: int) -> List[int]:
    """Client i's prompt: token ids of its own, 12 to 19 of them."""
    return [1000 + 37 * i + j for j in range(12 + i % 8)]


@dataclass
class Stream:
    """What one streaming client read."""

    index: int
    text: str = ""
    tokens: int = 0
    error: Optional[Dict[str, Any]] = None
    done: bool = False  # read [DONE]
    failure: Optional[str] = None  # the connection broke, or it was not a 200
    first_token: asyncio.Event = field(default_factory=asyncio.Event)
    ended_at: Optional[float] = None  # time.monotonic() when it ended


async def _stream(client: httpx.AsyncClient, url: str, model: str, s: Stream, max_tokens: int) -> None:
    body = {
        "model": model,
        "prompt": prompt_ids(s.index),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                s.failure = f"status {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    s.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    s.error = event["error"]
                    continue
                s.text += event["choices"][0].get("text", "")
                s.tokens += 1
                s.first_token.set()
    except (httpx.HTTPError, ValueError, LookupError) as e:  # a broken connection, or an event not understood
        s.failure = f"{type(e).__name__}: {e}"
    finally:
        s.ended_at = time.monotonic()
        s.first_token.set()  # a wave waits for a token or an end


async def run_load(url: str, clients: int, max_tokens: int, timeout: float = 120.0) -> List[Stream]:
    """`clients` streaming completions in two waves (the second once each of the first streamed)."""
    streams = [Stream(i) for i in range(clients)]
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        first, second = streams[: clients // 2], streams[clients // 2 :]
        tasks = [asyncio.create_task(_stream(client, url, model, s, max_tokens)) for s in first]
        await asyncio.wait([asyncio.create_task(s.first_token.wait()) for s in first], timeout=timeout)
        for s in second:  # in order, so their uids follow the client index
            tasks.append(asyncio.create_task(_stream(client, url, model, s, max_tokens)))
            await asyncio.sleep(0.01)
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:  # a hang: what the facility must never produce
            task.cancel()
        for s in streams:
            if s.ended_at is None or (not s.done and s.failure is None and s.error is None):
                s.failure = s.failure or f"hung: no end after {timeout:g} s ({s.tokens} tokens read)"
    return streams


@dataclass
class KindReport:
    kind: str
    spec: str
    errors: List[int]  # client indices that ended with an error event
    finished: List[int]
    equal: int  # of the finished, how many equal the fault-free run
    broken: List[str]  # connections that broke or were refused
    health_after: Optional[str] = None
    integrity: Optional[Dict[str, Any]] = None
    served_after: Optional[bool] = None
    exit_code: Optional[int] = None
    exit_s: Optional[float] = None  # from the first error event to the process's exit
    health_while_dying: Optional[str] = None
    error_messages: List[str] = field(default_factory=list)

    def lines(self) -> List[str]:
        out = [
            f"{self.kind}  ({self.spec})",
            f"  requests ended with an error event: {len(self.errors)} {self.errors}",
            f"    errors: {sorted(set(self.error_messages))}",
            f"  requests finished: {len(self.finished)}, equal to the fault-free run: {self.equal}",
            f"  connections broken or refused: {len(self.broken)}",
        ]
        if self.integrity is not None:
            i = self.integrity["integrity"]
            e = self.integrity["engine"]
            out += [
                f"  /health after: {self.health_after}",
                f"  idle integrity check: ok={i['ok']}, checks={i['checks']}, leaked pages={i['leaked_pages']}, "
                f"locked tokens={i['locked_tokens']}, error={i['error']}",
                f"  --verify: {e['verified_ops']} of {e['cache_ops']} cache operations mirrored and agreed; "
                f"faults counted: {e.get('faults')}",
                f"  a request after the fault served: {self.served_after}",
            ]
        if self.exit_code is not None or self.exit_s is not None:
            out += [
                f"  /health while dying: {self.health_while_dying}",
                f"  process exit status {self.exit_code}, {self.exit_s:.2f} s after the first error event"
                if self.exit_s is not None
                else f"  process exit status {self.exit_code}",
            ]
        return out


def _health(url: str) -> str:
    try:
        r = httpx.get(f"{url}/health", timeout=5)
        return f"{r.status_code} {r.text}"
    except httpx.HTTPError as e:
        return f"no answer ({type(e).__name__})"


async def _poll_health(url: str, polls: List[Tuple[float, int, str]], stop: asyncio.Event) -> None:
    """Ask /health every 50 ms until stopped: (asked at, status or 0 for no answer, body)."""
    async with httpx.AsyncClient(timeout=2) as client:
        while not stop.is_set():
            asked = time.monotonic()
            try:
                r = await client.get(f"{url}/health")
                polls.append((asked, r.status_code, r.text))
            except httpx.HTTPError:
                polls.append((asked, 0, ""))
            await asyncio.sleep(0.05)


def run_kind(
    kind: Optional[str], clients: int, max_tokens: int, server_args: Sequence[str], reference: Optional[List[str]]
) -> tuple[List[Stream], Optional[KindReport]]:
    """One server, one load: with `kind`'s fault, or none (kind None: the reference run)."""
    args = list(server_args)
    spec = spec_for(kind, clients) if kind is not None else ""
    if kind is not None:
        args += ["--inject-fault", spec]
    if kind == "step-stall":
        args += ["--step-timeout", str(STEP_TIMEOUT_S)]
    srv = ServerProcess(args)
    srv.start()
    exit_at: List[float] = []  # when the process exited, as its waiter saw it
    assert srv.proc is not None
    proc = srv.proc

    def wait_exit() -> None:
        try:
            proc.wait(EXIT_WAIT_S + 300)
            exit_at.append(time.monotonic())
        except Exception:
            pass

    threading.Thread(target=wait_exit, daemon=True).start()
    try:
        polls: List[Tuple[float, int, str]] = []

        async def load() -> List[Stream]:
            stop = asyncio.Event()
            watch = asyncio.create_task(_poll_health(srv.url, polls, stop))
            try:
                streams = await run_load(srv.url, clients, max_tokens)
                waited = time.monotonic()
                while kind not in (None, *CONTAINED) and proc.poll() is None:  # /health until the exit
                    if time.monotonic() - waited > EXIT_WAIT_S:
                        break
                    await asyncio.sleep(0.02)
                return streams
            finally:
                stop.set()
                await watch

        streams = asyncio.run(load())
        if kind is None:
            return streams, None
        assert reference is not None
        report = KindReport(
            kind,
            spec,
            errors=[s.index for s in streams if s.error is not None],
            finished=[s.index for s in streams if s.error is None and s.failure is None],
            equal=sum(s.error is None and s.failure is None and s.text == reference[s.index] for s in streams),
            broken=[f"{s.index}: {s.failure}" for s in streams if s.failure is not None],
            error_messages=[str(s.error.get("message")) for s in streams if s.error is not None],
        )
        if kind in CONTAINED:
            _after_contained(srv, report)
        else:
            _after_fatal(srv, report, streams, polls, exit_at)
        return streams, report
    finally:
        srv.stop()


def _after_contained(srv: ServerProcess, report: KindReport) -> None:
    deadline = time.monotonic() + 30
    while True:  # the worker checks integrity once it is idle
        integrity = httpx.get(f"{srv.url}/debug/integrity", timeout=10).json()
        if integrity["engine"]["running"] == 0 and integrity["integrity"]["checks"] > 0:
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    report.integrity = integrity
    report.health_after = _health(srv.url)
    model = httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"][0]["id"]
    r = httpx.post(
        f"{srv.url}/v1/completions",
        json={"model": model, "prompt": prompt_ids(0), "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    report.served_after = r.status_code == 200


def _after_fatal(
    srv: ServerProcess,
    report: KindReport,
    streams: List[Stream],
    polls: List[Tuple[float, int, str]],
    exit_at: List[float],
) -> None:
    assert srv.proc is not None
    try:
        report.exit_code = srv.proc.wait(EXIT_WAIT_S)
    except Exception:
        report.exit_code = None  # it hung
    deadline = time.monotonic() + 5
    while not exit_at and time.monotonic() < deadline:
        time.sleep(0.01)
    ends = [s.ended_at for s in streams if s.error is not None and s.ended_at is not None]
    report.exit_s = exit_at[0] - min(ends) if ends and exit_at else None
    first = min(ends) if ends else float("inf")
    after = [(status, body) for asked, status, body in polls if asked > first]
    dying = [body for _, status, body in polls if status not in (0, 200)]
    report.health_while_dying = (
        f"asked {len(after)} times after the first error event: {sum(st == 200 for st, _ in after)} x 200, "
        f"{sum(st == 503 for st, _ in after)} x 503, {sum(st == 0 for st, _ in after)} x no answer (exited); "
        f"first non-200: {dying[0] if dying else 'none'}"
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvledger.bench.faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    a = p.parse_args(argv)
    if a.clients < 4:
        p.error("--clients must be at least 4 (two waves)")
    args = [*SERVER_ARGS, "--threads", str(a.threads)]
    started = time.monotonic()
    base, _ = run_kind(None, a.clients, a.max_tokens, args, None)
    reference = [s.text for s in base]
    bad = [s.index for s in base if s.error is not None or s.failure is not None]
    print(f"fault-free run: {a.clients} streaming clients, {a.max_tokens} tokens each, {len(bad)} failed", flush=True)
    for kind in a.kinds:
        _, report = run_kind(kind, a.clients, a.max_tokens, args, reference)
        assert report is not None
        print("\n".join(report.lines()), flush=True)
    print(f"total {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
