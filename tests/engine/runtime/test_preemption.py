"""Optimistic admission on the real model (CPU): with a pool so small that requests are preempted
again and again, every request's tokens equal those of a run with a pool big enough for all of
them, greedy and seeded sampling, with and without overlap, with every cache operation shadowed
in the reference model; the recorded trace replays on both implementations."""

import pytest
import torch

from kvledger.engine.ledger.trace import read
from kvledger.engine.model.default_model import default_model_path
from kvledger.engine.runtime.llm import LLM
from kvledger.fast import SamplingParams
from kvledger.properties.lockstep import replay

try:
    MODEL = default_model_path()
except FileNotFoundError as e:  # pragma: no cover - the set-up installs it
    pytest.skip(str(e), allow_module_level=True)

PROMPTS = [
    "The capital of France is",
    "List three prime numbers:",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "1 + 1 =",
    "Write a haiku about autumn leaves falling gently on a quiet river at dusk.",
]
NEW_TOKENS = 30
ENGINE = dict(page_size=4, max_running_req=8, max_seq_len=256)


def _params(kind):
    if kind == "greedy":
        return [SamplingParams(max_tokens=NEW_TOKENS) for _ in PROMPTS]
    return [
        SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=NEW_TOKENS) for i in range(len(PROMPTS))
    ]


@pytest.fixture(scope="module")
def unconstrained():
    torch.set_num_threads(1)  # xdist runs one worker per core
    llm = LLM(kv_cache_tokens=4096, **ENGINE)
    return {
        kind: [(o.token_ids, o.finish_reason) for o in llm.generate(PROMPTS, _params(kind))]
        for kind in ("greedy", "seeded")
    }


@pytest.mark.parametrize("kind,overlap", [("greedy", False), ("greedy", True), ("seeded", False)])
def test_heavy_preemption_changes_no_token(unconstrained, kind, overlap, tmp_path):
    path = tmp_path / "run.jsonl"
    # 48 tokens: the longest request alone (16 prompt + 30 output tokens) fits, two rarely do
    llm = LLM(
        kv_cache_tokens=48,
        admission="optimistic",
        reserve_ratio=0.0,
        verify=True,
        overlap=overlap,
        max_prefill_tokens=8,
        trace=str(path),
        **ENGINE,
    )
    got = [(o.token_ids, o.finish_reason) for o in llm.generate(PROMPTS, _params(kind))]
    llm.close()
    assert got == unconstrained[kind]
    driver = llm.engine.cache_scheduler
    assert driver.preemptions >= 5
    assert llm.shadow.steps > 100  # every operation was mirrored and compared
    header, ops = read(path)
    assert (header.admission, header.reserve_ratio) == ("optimistic", 0.0)
    assert sum(len(rec.to_json().get("expect", {}).get("preempted", [])) for rec in ops) == driver.preemptions
    lock = replay(header, ops)
    assert (lock.ref.preemptions, lock.ref.recomputed_tokens) == (driver.preemptions, driver.recomputed_tokens)


def test_reserve_never_preempts_and_optimistic_runs_more_at_once():
    """Same pool, same requests: reserve admits by worst case (so it never preempts), optimistic
    by half of max_tokens; optimistic has more requests decoding at once."""
    params = [SamplingParams(max_tokens=40, ignore_eos=True) for _ in PROMPTS]
    peaks = {}
    for admission in ("reserve", "optimistic"):
        llm = LLM(kv_cache_tokens=128, admission=admission, **ENGINE)
        peak = 0
        for p, sp in zip(PROMPTS, params):
            llm.engine.add_request(llm.encode(p), sp, len(peaks) * 100 + PROMPTS.index(p))
        while llm.engine.has_work:
            llm.engine.step()
            peak = max(peak, len(llm.engine.cache_scheduler.dm.running_reqs))
        peaks[admission] = (peak, llm.engine.cache_scheduler.preemptions)
    assert peaks["reserve"][1] == 0
    assert peaks["optimistic"][0] > peaks["reserve"][0]
