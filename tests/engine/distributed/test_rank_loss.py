"""A rank lost mid-request (killed or stopped), on the CPU over gloo with two ranks: rank 0 raises
RankLost naming the rank and how it went, no rank process is left, and an idle engine learns of it
too. The signals are sent at a chosen step (rank 0's hook), so the test decides by events; the
timeouts below only guard against a hang."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import time

import pytest

from kvledger.engine.distributed.rank_errors import RankFailed, RankLost
from kvledger.engine.distributed.rank_watch import process_state
from kvledger.engine.runtime.llm import LLM
from kvledger.fast import SamplingParams
from tests.support.models import tiny_config

TINY = tiny_config(
    vocab_size=307, intermediate_size=99, num_heads=6, num_kv_heads=3, tie_word_embeddings=False, eos_token_ids=(5,)
)
PROMPTS = [list(range(20, 52)) + [1, 2, 3], list(range(100, 140)), [3, 1, 4, 1, 5, 9]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
HANG_GUARD_S = 60.0  # only ends a test that would otherwise hang; nothing is decided by it
pytestmark = pytest.mark.timeout(300)  # a rank nobody notices would hang a collective for 10 minutes


def _rank_children():
    return [p for p in multiprocessing.active_children() if p.name.startswith("kvledger-rank")]


def _signal_rank_1(sig: int) -> None:
    (child,) = [p for p in _rank_children() if p.name == "kvledger-rank1"]
    os.kill(child.pid, sig)


def kill_rank_1_at_step_3(rank, step, engine):
    if rank == 0 and step == 3:
        _signal_rank_1(signal.SIGKILL)


def stop_rank_1_at_step_3(rank, step, engine):
    if rank == 0 and step == 3:
        _signal_rank_1(signal.SIGSTOP)


def freeze_rank_1_at_step_3(rank, step, engine):
    if rank == 1 and step == 3:  # libc's sleep through PyDLL keeps the GIL: the heartbeat thread stops too
        ctypes.PyDLL(None).sleep(600)


def _gone(pid: int) -> bool:
    """Not running and reaped: no /proc entry (a zombie still has one)."""
    return process_state(pid) is None


@pytest.mark.parametrize(
    "hook,how",
    [
        (kill_rank_1_at_step_3, "killed by SIGKILL"),
        (stop_rank_1_at_step_3, r"stopped \(SIGSTOP\)"),
        (freeze_rank_1_at_step_3, r"no heartbeat for \d+\.\d s \(process state S\)"),
    ],
    ids=["sigkill", "sigstop", "frozen"],
)
def test_a_rank_killed_or_stopped_mid_generation_ends_the_run_with_rank_lost(hook, how):
    llm = LLM(TINY, dummy_weights=True, tensor_parallel_size=2, threads=1, page_size=2, rank_hook=hook)
    (child,) = _rank_children()
    try:
        with pytest.raises(RankLost, match=f"tensor-parallel rank 1 lost: {how}") as raised:
            llm.generate(PROMPTS, PARAMS)
        assert raised.value.rank == 1 and isinstance(raised.value, RankFailed)
        assert llm.ranks is not None and llm.ranks.failure is raised.value
        assert _rank_children() == [] and _gone(child.pid)  # killed (the stopped one too) and reaped at once
        with pytest.raises(RuntimeError, match="tensor-parallel engine has stopped"):
            llm.generate(PROMPTS[:1], PARAMS)
    finally:
        llm.close()
    assert _rank_children() == [] and _gone(child.pid)


@pytest.mark.parametrize("sig,how", [(signal.SIGKILL, "killed by SIGKILL"), (signal.SIGSTOP, "stopped")])
def test_an_idle_engine_learns_that_a_rank_was_lost_and_its_next_step_raises(sig, how):
    llm = LLM(TINY, dummy_weights=True, tensor_parallel_size=2, threads=1, page_size=2)
    try:
        assert [len(o.token_ids) for o in llm.generate(PROMPTS[:1], PARAMS)] == [12]
        assert not llm.engine.has_work
        (child,) = _rank_children()
        os.kill(child.pid, sig)
        deadline = time.monotonic() + HANG_GUARD_S
        while not llm.engine.has_work and time.monotonic() < deadline:  # the watch's event, polled
            time.sleep(0.05)
        assert llm.engine.has_work, "the loss never reached the engine"
        assert _gone(child.pid)
        with pytest.raises(RankLost, match=f"rank 1 lost: {how}"):
            llm.engine.step()
    finally:
        llm.close()
    assert _rank_children() == []


def test_a_clean_close_is_no_loss():
    llm = LLM(TINY, dummy_weights=True, tensor_parallel_size=2, threads=1, page_size=2)
    (child,) = _rank_children()
    assert [len(o.token_ids) for o in llm.generate(PROMPTS, PARAMS)] == [12, 12, 12]
    ranks = llm.ranks
    llm.close()
    assert ranks is not None and ranks.failure is None and child.exitcode == 0
    assert _rank_children() == [] and _gone(child.pid)


# -- the fault facility's rank kinds ------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec,how,through",
    [
        ("rank-kill@step=3,rank=1", "killed by SIGKILL", "option"),
        ("rank-stop@step=3,rank=1", r"stopped \(SIGSTOP\)", "environment"),
    ],
)
def test_an_injected_rank_fault_takes_the_rank_out_at_its_step(spec, how, through, monkeypatch):
    options = dict(dummy_weights=True, tensor_parallel_size=2, threads=1, page_size=2)
    if through == "option":
        options["inject_fault"] = spec
    else:
        monkeypatch.setenv("KVLEDGER_INJECT_FAULT", spec)  # the spawned rank inherits it
    llm = LLM(TINY, **options)
    (child,) = _rank_children()
    try:
        with pytest.raises(RankLost, match=f"rank 1 lost: {how}"):
            llm.generate(PROMPTS, PARAMS)
        assert llm.engine.coordination.steps == 3  # rank 1 went at the step the spec names, not before
    finally:
        llm.close()
    assert _rank_children() == [] and _gone(child.pid)


def test_a_rank_fault_naming_a_rank_that_does_not_exist_is_refused_at_startup():
    with pytest.raises(ValueError, match=r"names rank 2, but the ranks are 0\.\.1"):
        LLM(TINY, dummy_weights=True, tensor_parallel_size=2, threads=1, inject_fault="rank-kill@step=1,rank=2")
    assert _rank_children() == []


# -- torchrun's ranks -----------------------------------------------------------------------------------
def test_under_torchrun_on_one_host_a_stopped_rank_is_lost_and_killed():
    import subprocess
    import sys

    generate = ["generate", "The capital of France is", "--max-tokens", "16", "--threads", "1", "--max-seq-len", "256"]
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "kvledger"]
        + [*generate, "--tp", "2", "--inject-fault", "rank-stop@step=3,rank=1"],
        capture_output=True,
        text=True,
        timeout=600,  # without the watch rank 0 would wait in a collective for the group's 10 minutes
    )
    assert run.returncode != 0
    assert "tensor-parallel rank 1 lost: stopped (SIGSTOP)" in run.stderr, run.stderr[-3000:]


# -- rank 0 lost ------------------------------------------------------------------------------------------
RANK_0 = """
import sys, time
from kvledger.engine.runtime.llm import LLM
from tests.engine.distributed.test_rank_loss import TINY, _rank_children
if __name__ == "__main__":
    llm = LLM(TINY, dummy_weights=True, tensor_parallel_size=2, threads=1, page_size=2)
    print(_rank_children()[0].pid, flush=True)
    time.sleep(600)
"""


def test_the_ranks_of_a_rank_0_that_was_killed_leave():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    rank_0 = subprocess.Popen([sys.executable, "-c", RANK_0], cwd=root, env=env, stdout=subprocess.PIPE, text=True)
    try:
        rank_1 = int(rank_0.stdout.readline())  # rank 0 is up, rank 1 waits for its next step
        rank_0.kill()
        rank_0.wait(30)
        deadline = time.monotonic() + HANG_GUARD_S
        while process_state(rank_1) not in (None, "Z") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_state(rank_1) in (None, "Z"), "rank 1 outlived its rank 0"
    finally:
        if rank_0.poll() is None:
            rank_0.kill()
