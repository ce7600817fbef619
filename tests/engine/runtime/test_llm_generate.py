"""The engine end to end on the embedded SmolLM2-135M (CPU, float32): greedy parity with
transformers, prefix reuse, a pool too small for everything at once, the seed's 64-page example,
bad requests, shadow verification and trace replay."""

import os

import pytest
import torch

from kvledger.engine.ledger.ops import Prefill
from kvledger.engine.ledger.trace import read
from kvledger.engine.model.default_model import default_model_path
from kvledger.engine.runtime.llm import LLM
from kvledger.fast import SamplingParams
from kvledger.properties.lockstep import replay

try:
    MODEL = default_model_path()
except FileNotFoundError as e:  # pragma: no cover - the set-up installs it
    pytest.skip(str(e), allow_module_level=True)

SHARED = (
    "Paged attention stores the key and value vectors of every token in fixed-size pages, "
    "and a page table maps each sequence position to a location in the pool. "
)
PROMPTS = [
    "The capital of France is",
    "List three prime numbers:",
    "def fibonacci(n):",
    SHARED + "Why does this help a serving engine?",
    SHARED + "What is the page table used for?",
    "Once upon a time, in a small village by the sea, there lived",
    "1 + 1 =",
    "Write a haiku about autumn leaves falling gently on a quiet river at dusk.",
]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def small_llm():
    torch.set_num_threads(1)  # xdist runs one worker per core
    return LLM(page_size=16, kv_cache_tokens=4096, max_running_req=16, max_seq_len=512)


@pytest.fixture(scope="module")
def transformers_greedy(small_llm):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(MODEL), gguf_file=os.path.basename(MODEL), dtype=torch.float32
    ).eval()
    outs = []
    for p in PROMPTS:
        ids = torch.tensor([small_llm.encode(p)])
        with torch.inference_mode():
            gen = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=small_llm.tokenizer.eos_token_id,
            )
        outs.append(gen[0, ids.shape[1] :].tolist())
    return outs


@pytest.mark.parametrize(
    "page_size,cache_type,budget", [(1, "radix", 24), (16, "radix", 24), (1, "naive", 2048), (16, "naive", 24)]
)
def test_greedy_matches_transformers(transformers_greedy, page_size, cache_type, budget):
    llm = LLM(
        page_size=page_size,
        cache_type=cache_type,
        kv_cache_tokens=4096,
        max_running_req=16,
        max_seq_len=512,
        max_prefill_tokens=budget,
        verify=True,
    )
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS))
    assert [o.token_ids for o in outs] == transformers_greedy
    if budget < 40:
        assert max(len(o.prompt_token_ids) for o in outs) > budget  # prompts were split into chunks
    llm.engine.check_idle()


def test_duplicate_prompts_and_prefix_cache_hit(small_llm):
    p = PROMPTS[3]
    params = SamplingParams(max_tokens=8)
    single = small_llm.generate([p], params)[0].token_ids
    pair = small_llm.generate([p, p], params)
    assert [o.token_ids for o in pair] == [single, single]
    again = small_llm.generate([p], params)[0]
    assert again.token_ids == single
    assert again.cached_tokens >= len(again.prompt_token_ids) - 16  # hit all but a partial page
    assert not small_llm.engine.requests  # every request's record is dropped when it ends


def test_pool_too_small_gives_the_same_tokens(small_llm):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    big = small_llm.generate(PROMPTS, params)
    tiny = LLM(page_size=4, kv_cache_tokens=160, max_running_req=16, max_seq_len=128, verify=True)
    waits = []
    tiny.engine.cache_scheduler.after_forward = lambda phase, batch: waits.append(
        len(tiny.engine.cache_scheduler.waiting)
    )
    small = tiny.generate(PROMPTS, params)
    assert [o.token_ids for o in small] == [o.token_ids for o in big]
    assert max(waits) > 0  # some requests had to wait for others
    cm = tiny.engine.cache_scheduler.cm
    cm.check_integrity()
    assert len(cm.free_slots) * 4 + cm.prefix_cache.size_info.total_size == 160  # every page back


def test_the_seeds_64_page_example_with_the_real_model(capsys):
    llm = LLM(page_size=1, kv_cache_tokens=64, cache_type="naive", max_running_req=8, max_seq_len=128)
    prompts = [
        "The capital of France is",
        "List three prime numbers:",
        "def fibonacci(n):",
        "Once upon a time, in a small village by the sea, there lived",
        "1 + 1 =",
    ]
    d = llm.engine.cache_scheduler
    rows = []

    def trace(phase, batch):
        rows.append((phase, [r.uid for r in batch], len(d.waiting), len(d.cm.free_slots), d.dm.inflight_tokens))
        print(
            f"  {phase:<7} uids={[r.uid for r in batch]!s:<16} waiting={len(d.waiting)} "
            f"free pages={len(d.cm.free_slots):<3} reserved for running={d.dm.inflight_tokens}"
        )

    d.after_forward = trace
    print("prompt lengths:", [len(llm.encode(p)) for p in prompts], " max_tokens = 8")
    llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    d.cm.check_integrity()
    print("all done, free pages:", len(d.cm.free_slots), "/ 64, integrity check passed")
    assert rows[0][:3] == ("prefill", [0, 1, 2, 3], 1)  # the fifth waits
    assert all(r[2] == 1 for r in rows[:8]) and rows[8][:2] == ("prefill", [4])
    assert rows[0][4] == 4 * 7 + 0 and len(d.cm.free_slots) == 64
    assert "free pages" in capsys.readouterr().out


def test_bad_requests_get_a_clear_error_and_the_rest_run(small_llm):
    vocab = small_llm.model_config.vocab_size
    outs = small_llm.generate(
        ["Hello there", "", [5, vocab + 3], "fine too", "x " * 600],
        [
            SamplingParams(max_tokens=4),
            SamplingParams(max_tokens=4),
            SamplingParams(max_tokens=4),
            SamplingParams(max_tokens=0),
            SamplingParams(max_tokens=4),
        ],
    )
    ok, empty, oov, zero, long = outs
    assert ok.error is None and len(ok.token_ids) >= 1
    assert isinstance(empty.error, ValueError) and "prompt" in str(empty.error)
    assert isinstance(oov.error, ValueError) and "vocabulary" in str(oov.error)
    assert isinstance(zero.error, ValueError) and "max_tokens" in str(zero.error)
    assert isinstance(long.error, ValueError) and "max_seq_len" in str(long.error)
    with pytest.raises(ValueError, match="temperature"):
        small_llm.engine.limits.validate([1, 2], SamplingParams(temperature=-1.0))


def test_seeded_sampling_replays_and_top_k_1_is_greedy(small_llm):
    p = "Tell me a story about a robot:"
    hot = SamplingParams(max_tokens=12, temperature=1.2, top_p=0.9, top_k=50, seed=7)
    a, b = small_llm.generate([p, p], [hot, hot])
    assert a.token_ids == b.token_ids  # same seed, same tokens, whatever shares the batch
    greedy = small_llm.generate([p], SamplingParams(max_tokens=12))[0].token_ids
    top1 = small_llm.generate([p], SamplingParams(max_tokens=12, temperature=0.8, top_k=1, seed=3))[0].token_ids
    assert top1 == greedy


def test_verify_and_trace_on_a_mixed_workload(tmp_path):
    path = tmp_path / "engine.jsonl"
    llm = LLM(
        page_size=4,
        kv_cache_tokens=512,
        max_running_req=4,
        max_seq_len=256,
        max_prefill_tokens=32,
        verify=True,
        trace=str(path),
    )
    params = [SamplingParams(max_tokens=n, ignore_eos=bool(n % 2)) for n in (3, 9, 5, 14, 7, 2)]
    outs = llm.generate(PROMPTS[:6], params)
    llm.close()
    assert all(o.error is None for o in outs)
    assert llm.shadow.steps > 15
    header, ops = read(path)
    assert header.producer == "engine" and any(isinstance(record.op, Prefill) for record in ops)
    lock = replay(header, ops)  # the engine's trace replays on reference and fast in lockstep
    assert not lock.ref.live and lock.fast.cm.available_size == 512
