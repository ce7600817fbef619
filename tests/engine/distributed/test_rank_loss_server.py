"""`kvledger serve --tp 2` losing rank 1 under load (CPU, gloo, the embedded model): the fault
facility makes rank 1 kill or stop itself at step 4, while 4 streaming and 2 plain completions run
(kvledger/bench/rank_loss.py drives it and watches from outside). Every request ends with an error
(an error event, or a 500 with an OpenAI error body), /health names the lost rank from the first
error on, the server exits with status 1 and leaves no process behind. Decided by what each client
and probe saw, not by how fast (the bench prints the times)."""

from __future__ import annotations

import pytest

from kvledger.bench.rank_loss import run_once

pytestmark = pytest.mark.timeout(900)


@pytest.mark.parametrize("loss", ["kill", "stop"])
def test_the_server_fails_every_request_and_exits_when_rank_1_is_lost(loss):
    out = run_once(loss, "inject", clients=4, non_stream=2, max_tokens=64, step=4)
    ends = [(e.stream, e.kind, e.detail[:120]) for e in out.ends]
    assert out.count(True, "error") == 4 and out.count(False, "error") == 2, ends
    assert all(e.detail.startswith("error event: ") for e in out.ends if e.stream), ends
    assert all(e.detail.startswith(("status 500: ", "status 503: ")) for e in out.ends if not e.stream), ends
    assert out.exit_code == 1
    assert out.orphans == []
    how = "killed by SIGKILL" if loss == "kill" else "stopped (SIGSTOP)"
    assert out.detected_s is not None and any(f"rank 1 lost: {how}" in line for line in out.log_lines)
    first_error = min(e.at for e in out.ends) - out.t0
    after = [(code, text) for at, code, text in out.health_answers if at >= first_error]
    assert all(code == 0 or (code == 503 and "rank 1 lost" in text) for code, text in after), after
