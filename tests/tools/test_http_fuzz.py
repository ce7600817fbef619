"""Seeded random HTTP requests against a real `kvledger serve --verify` (kvledger/tools/http_fuzz.py):
malformed JSON, wrong types, extreme values, huge numbers, deep nesting, lone surrogates, odd
headers, routes and framing, oversized bodies. No case may get a 5xx or take /health down, the
server logs no traceback, and afterwards the idle integrity check finds no leaked page and no
locked token. For a longer run: `python -m kvledger.tools.http_fuzz --url ... --cases N --seed S`."""

from __future__ import annotations

import time

from kvledger.engine.server.launch import ServerProcess
from kvledger.tools import http_fuzz

KEY = "fuzz-key"
SEED = 20240601
CASES = 300


def test_random_requests_never_get_a_5xx_and_leave_no_leak():
    with ServerProcess(["--api-key", KEY, "--verify", "--max-seq-len", "256", "--kv-cache-tokens", "2048"]) as srv:
        cases = http_fuzz.generate_cases(SEED, CASES, http_fuzz.Target(KEY))
        checks = http_fuzz.integrity_checks(srv.url, KEY)
        started = time.monotonic()
        summary = http_fuzz.run_cases(srv.url, cases, timeout=30)
        http_fuzz.wait_idle_integrity(srv.url, KEY, summary, checks)
        print(f"\n{summary.format()}\n({time.monotonic() - started:.1f} s)")
        log = srv.log(tail=None)

    assert summary.cases == CASES
    assert not summary.server_errors, summary.format()
    assert not summary.stream_errors, summary.format()
    assert not summary.incomplete, summary.format()
    assert not summary.health_failures, summary.format()
    assert "Traceback" not in log, log[max(0, log.index("Traceback") - 2000) :][:8000]
    assert summary.integrity_error is None, summary.integrity_error
    assert summary.integrity["ok"] and summary.integrity["leaked_pages"] == 0
    assert summary.integrity["locked_tokens"] == 0
