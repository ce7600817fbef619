"""Injected faults in a real `kvledger serve --verify` (embedded model) under 8 concurrent streaming
clients: a contained fault ends the requests it touched with an error event, the others equal a
fault-free run, no page leaks and --verify agrees, the server stays healthy; cuda-poison and a
stalled step (the watchdog) turn /health to 503, fail every stream with an error event and exit 1.
Decided by counts; the times are only hang guards (the 5 s exit is measured by kvledger.bench.faults)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from typing import List, Optional, Tuple

import httpx
import pytest

from kvledger.bench.faults import SERVER_ARGS, Stream, run_load, spec_for
from kvledger.engine.server.launch import ROOT, ServerProcess

CLIENTS = 8
TOKENS = 12
ARGS = [*SERVER_ARGS, "--threads", "1"]
REFUSED = ("status 503", "ConnectError")  # a request that came after the engine died, or after the exit


def load(srv: ServerProcess) -> List[Stream]:
    return asyncio.run(run_load(srv.url, CLIENTS, TOKENS, timeout=180))


@pytest.fixture(scope="module")
def reference() -> List[str]:
    with ServerProcess(ARGS) as srv:
        streams = load(srv)
    assert all(s.done and s.error is None and s.failure is None for s in streams)
    return [s.text for s in streams]


def idle_integrity(srv: ServerProcess) -> dict:
    for _ in range(300):
        report = httpx.get(f"{srv.url}/debug/integrity", timeout=10).json()
        if report["engine"]["running"] == 0 and report["integrity"]["checks"] > 0:
            return report
        time.sleep(0.1)
    raise AssertionError(f"the server never went idle: {report}")


@pytest.mark.parametrize("kind, ended", [("forward-raise", None), ("alloc-refuse", 1)])
def test_a_contained_fault_ends_what_it_touched_and_nothing_else(reference, kind: str, ended: Optional[int]):
    with ServerProcess([*ARGS, "--inject-fault", spec_for(kind, CLIENTS)]) as srv:
        streams = load(srv)
        errors = [s.index for s in streams if s.error is not None]
        assert all(s.failure is None and s.done for s in streams), [s.failure for s in streams]
        assert errors and (ended is None or len(errors) == ended)
        assert all(i >= CLIENTS // 2 for i in errors)  # the fault named a request of the second wave
        assert all(s.error["type"] == "server_error" for s in streams if s.error is not None)
        assert [s.text for s in streams if s.error is None] == [reference[s.index] for s in streams if s.error is None]
        report = idle_integrity(srv)
        integrity, engine = report["integrity"], report["engine"]
        assert integrity["ok"] and integrity["leaked_pages"] == 0 and integrity["locked_tokens"] == 0
        assert engine["verified_ops"] == engine["cache_ops"] and report["fault"] is None
        assert engine["faults"] == {f"faults_{kind.replace('-', '_')}": 1}
        assert engine["failed"] == len(errors)
        assert httpx.get(f"{srv.url}/health", timeout=10).json() == {"status": "ok"}
        log = srv.log(tail=None)
        assert f"(injected {kind})" in log and "Traceback" not in log


def _dies(args: List[str], needle: str, must_see_503: bool) -> None:
    """Every open stream ends with an error event, the process exits 1, and /health, asked from before
    the first error event until the exit, never answers 200 after it (503 with the reason, or no
    answer once the process is gone). must_see_503: a 503 must be seen (a stall lasts seconds)."""
    with ServerProcess([*ARGS, *args]) as srv:
        proc = srv.proc
        assert proc is not None
        polls: List[Tuple[float, int, str]] = []  # (asked at, status or 0 for no answer, body)

        def watch() -> None:
            while proc.poll() is None:
                asked = time.monotonic()
                try:
                    r = httpx.get(f"{srv.url}/health", timeout=2)
                    polls.append((asked, r.status_code, r.text))
                except httpx.HTTPError:
                    polls.append((asked, 0, ""))
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        streams = load(srv)
        assert proc.wait(60) == 1
        watcher.join(10)
        # every open request ends with an error event (one of the first wave may have finished
        # before the fault, which names a request of the second); one that arrived after the engine
        # died is refused with a 503, or finds the port closed once the process is gone; none hangs
        assert any(s.error is not None and s.done for s in streams)
        assert all(s.done or (s.failure or "").startswith(REFUSED) for s in streams), [s.failure for s in streams]
        first_error = min(s.ended_at for s in streams if s.error is not None and s.ended_at is not None)
        after = [(status, body) for asked, status, body in polls if asked > first_error]
        assert all(status != 200 for status, _ in after), after
        assert all(needle in body for status, body in after if status == 503), after
        assert not must_see_503 or any(status == 503 for _, status, _ in polls)
        assert needle in srv.log(tail=None)


def test_cuda_poison_fails_every_stream_says_so_on_health_and_exits_1():
    _dies(["--inject-fault", spec_for("cuda-poison", CLIENTS)], "illegal memory access", must_see_503=False)


def test_a_stalled_step_is_declared_by_the_watchdog_and_the_server_exits_1():
    _dies(["--inject-fault", spec_for("step-stall", CLIENTS), "--step-timeout", "2"], "stall", must_see_503=True)


@pytest.mark.parametrize(
    "args, env, words",
    [
        (["--inject-fault", "forward-raise@step=0"], {}, "--inject-fault"),
        ([], {"KVLEDGER_INJECT_FAULT": "melt@step=1"}, "KVLEDGER_INJECT_FAULT"),
        (["--step-timeout", "-1"], {}, "--step-timeout"),
    ],
)
def test_a_bad_fault_spec_or_timeout_fails_at_start_up_in_one_line(args, env, words):
    done = subprocess.run(
        [sys.executable, "-m", "kvledger", "serve", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE", "PATH": "/usr/bin:/bin", **env},
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in done.stderr, done.stderr
