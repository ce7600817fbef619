"""The engine on CUDA: against transformers' greedy generate (float32), CUDA graphs and overlap
against the eager serial engine, a graph decode launch that never waits for the GPU, and heavy
preemption that changes no greedy token. `cuda`-marked: skipped without a CUDA device."""

import pytest
import torch

from tests.support.models import nano_like, tiny_qwen3

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("attention", ["triton", "torch"])
def test_engine_on_cuda_matches_transformers_greedy_float32(tmp_path, attention):
    """A small random Llama saved as a Hugging Face directory: our engine on the GPU (page sizes 1
    and 16, chunked prefill, shadow-verified) against transformers' greedy generate."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvledger.engine.runtime.llm import LLM
    from kvledger.fast import SamplingParams

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    hf = LlamaForCausalLM(cfg).eval()
    for p in hf.parameters():  # larger weights so greedy picks are not near-ties
        p.data.normal_(0, 0.08)
    hf.save_pretrained(tmp_path)
    hf = hf.cuda()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (3, 17, 40, 64, 9, 100, 33, 5)]
    prompts[1] = prompts[5][:60] + prompts[1]  # a pair sharing a long prefix
    expected = []
    for ids in prompts:
        x = torch.tensor([ids], device="cuda")
        with torch.inference_mode():
            out = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=12,
                min_new_tokens=12,
                do_sample=False,
                pad_token_id=0,
            )
        expected.append(out[0, len(ids) :].tolist())
    for page_size, cache, budget in [(1, "radix", 32), (16, "naive", 2048), (16, "radix", 48)]:
        llm = LLM(
            str(tmp_path),
            device="cuda",
            attention=attention,
            page_size=page_size,
            cache_type=cache,
            kv_cache_tokens=4096,
            max_seq_len=256,
            max_prefill_tokens=budget,
            verify=True,
        )
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        assert [o.token_ids for o in outs] == expected, (attention, page_size, cache)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_and_overlap_match_the_eager_serial_engine(dtype, tmp_path):
    """Decode steps replayed from CUDA graphs, scheduled one step ahead, give the tokens of eager
    serial steps; batch sizes cross several captured sizes (40 requests, 6 slots .. 40)."""
    from kvledger.engine.ledger.trace import read
    from kvledger.engine.runtime.llm import LLM
    from kvledger.properties.lockstep import replay

    prompts, params = nano_like()
    kw = dict(
        dummy_weights=True,
        device="cuda",
        dtype=dtype,
        page_size=16,
        kv_cache_tokens=20000,
        max_running_req=40,
        max_seq_len=512,
        max_prefill_tokens=512,
    )
    eager = LLM(tiny_qwen3(), cuda_graphs=False, overlap=False, **kw)
    assert eager.engine.graphs is None and eager.model.uses_fused_path()
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    trace = tmp_path / "overlap.jsonl"
    fast_llm = LLM(tiny_qwen3(), cuda_graphs=True, overlap=True, trace=str(trace), **kw)
    assert fast_llm.engine.graphs is not None and fast_llm.engine.graphs.graphs
    got = [o.token_ids for o in fast_llm.generate(prompts, params)]
    fast_llm.close()
    assert got == expected
    header, ops = read(str(trace))
    replay(header, ops)  # the overlapped schedule's cache operations, on reference and fast


def test_overlap_with_graphs_under_shadow_verification():
    from kvledger.engine.runtime.llm import LLM
    from kvledger.fast import SamplingParams

    prompts, params = nano_like(n=24, seed=1)
    params = [
        SamplingParams(temperature=0.0, max_tokens=p.max_tokens) if i % 4 == 0 else p for i, p in enumerate(params)
    ]  # some may stop at EOS (token 5)
    llm = LLM(
        tiny_qwen3(),
        dummy_weights=True,
        device="cuda",
        dtype="bfloat16",
        page_size=4,
        kv_cache_tokens=3000,
        max_running_req=12,
        max_seq_len=512,
        max_prefill_tokens=256,
        verify=True,
    )
    outs = llm.generate(prompts, params)
    assert all(o.finish_reason in ("length", "stop") for o in outs)
    assert llm.shadow.steps > 50
    llm.engine.check_idle()


def test_a_graph_decode_launch_never_waits_for_the_gpu():
    """Scheduling and launching a decode step (allocation included) makes no synchronizing call."""
    from kvledger.engine.runtime.llm import LLM

    prompts, params = nano_like(n=16, seed=2)
    llm = LLM(
        tiny_qwen3(),
        dummy_weights=True,
        device="cuda",
        dtype="bfloat16",
        page_size=16,
        kv_cache_tokens=20000,
        max_running_req=16,
        max_seq_len=512,
        max_prefill_tokens=4096,
    )
    s = llm.engine
    for p, sp in zip(prompts, params):
        llm._submit(p, sp)
    while s.cache_scheduler.waiting:
        s.step()
    s.step()
    s.step()
    launched = 0
    for _ in range(20):
        if s.overlap.inflight is None or not s.cache_scheduler.has_runnable():
            break
        torch.cuda.set_sync_debug_mode("error")
        try:
            step = s._launch()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert step is not None and step.batch.phase == "decode"
        s._land(s.overlap.take_inflight())
        s._complete(step)
        s.overlap.hold(step)
        launched += 1
    assert launched >= 5
    while s.has_work:
        s.step()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_heavy_preemption_on_cuda_changes_no_greedy_token(dtype):
    """Optimistic admission in a pool barely larger than the longest request, with graphs and
    overlap, shadow-verified: requests are preempted over and over, and every greedy token equals
    that of a pool big enough for all of them at once."""
    from kvledger.engine.runtime.llm import LLM

    prompts, params = nano_like(n=24, seed=2)
    kw = dict(
        dummy_weights=True,
        device="cuda",
        dtype=dtype,
        page_size=16,
        max_running_req=24,
        max_seq_len=512,
        max_prefill_tokens=256,
    )
    expected = [o.token_ids for o in LLM(tiny_qwen3(), kv_cache_tokens=20000, **kw).generate(prompts, params)]
    small = LLM(tiny_qwen3(), kv_cache_tokens=320, admission="optimistic", reserve_ratio=0.0, verify=True, **kw)
    assert small.engine.overlap.enabled and small.engine.graphs is not None
    got = [o.token_ids for o in small.generate(prompts, params)]
    assert got == expected
    assert small.engine.cache_scheduler.preemptions >= 3
    small.engine.check_idle()
