"""The benchmarks' workloads: one Workload type, and a function that builds each named workload.

Every workload is seeded requests of token ids: `prompts`, what each request asks (`max_tokens`,
greedy, EOS ignored) and, where the benchmark ends requests itself as an EOS would, where it ends
each one (`output_lens`, unknown to the scheduler). The named ones:

* `nano_vllm`: nano-vllm's offline throughput workload (its bench.py): `random.seed(0)`, 256
  requests, prompts of `randint(100, 1024)` token ids drawn with `randint(0, 10000)` (first loop),
  then one `max_tokens = randint(100, 1024)` per request (second loop). That is exactly 142,827
  input and 133,966 output tokens; the upper bounds scale it down (the lower ones scale with them).
* `early_stop`: nano-vllm's prompt shape, one max_tokens for all, and output lengths drawn from a
  lognormal (`round(exp(N(ln median, sigma)))`, clamped to [1, max_tokens]).
* `shared_prefix`: SGLang's generated-shared-prefix shape: groups of requests that start with their
  group's random prefix and end with their own question, shuffled.
* `random_prompts`: prompts of uniform random length, one output length for all (`kvledger bench`).
* `online`: prompts that share a prefix within each group (`kvledger bench --serve`).
* `warmup`: a few short requests that are no prefix of a workload's (no prefix-cache hits).

No torch here: `kvledger --help` reads the constants.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

NANO_VLLM = "nano-vllm"
EARLY_STOP = "early-stop"
SHARED_PREFIX = "shared-prefix"
NAMES = (NANO_VLLM, EARLY_STOP, SHARED_PREFIX)  # `kvledger bench --workload`
EARLY_STOP_RATIOS = "0.5,0.1"  # the reserve ratios early-stop runs each preempting policy at, by default
NANO_NUM_REQUESTS = 256
NANO_MIN_LEN = 100
NANO_MAX_LEN = 1024
NANO_VOCAB_MAX = 10000  # randint(0, 10000): inclusive, so the model needs a vocabulary of at least 10,001
ONLINE_TOKEN_RANGE = (1000, 20000)  # ordinary vocabulary ids, clear of special tokens


@dataclass
class Workload:
    name: str
    prompts: List[List[int]]
    max_tokens: List[int]  # what each request asks: all the scheduler knows
    output_lens: Optional[List[int]] = None  # where the benchmark ends each request (None: at max_tokens)
    group_of: Optional[List[int]] = None  # each request's shared-prefix group
    info: Dict[str, Any] = field(default_factory=dict)  # the builder's description: a report's "workload"

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def targets(self) -> List[int]:
        """The tokens each request delivers."""
        return self.max_tokens if self.output_lens is None else self.output_lens

    @property
    def output_tokens(self) -> int:
        return sum(self.targets)

    @property
    def uniform_max_tokens(self) -> int:
        """The max_tokens every request asks (for the workloads that ask one for all)."""
        if len(set(self.max_tokens)) != 1:
            raise ValueError(f"workload {self.name}: its requests ask different max_tokens")
        return self.max_tokens[0]

    def describe(self) -> Dict[str, Any]:
        return dict(self.info)

    def kv_tokens(self, page_size: int, spare: int = 1) -> int:
        """KV tokens for every request to run at once at its longest, whole pages each (`spare`
        tokens more per request)."""
        return sum(pages(len(p) + m + spare, page_size) * page_size for p, m in zip(self.prompts, self.max_tokens))


def pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def percentile(sorted_values: Sequence[int], q: float) -> int:
    """The nearest-rank percentile (a value that occurs) of sorted values."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def scaled_min_len(max_len: int) -> int:
    """nano-vllm's lower length bound (100 of 1024), scaled with the upper bound."""
    return max(1, min(max_len, round(NANO_MIN_LEN * max_len / NANO_MAX_LEN)))


def _len_range(values: Sequence[int]) -> List[int]:
    return [min(values), max(values)] if values else [0, 0]


# -- the named workloads ----------------------------------------------------------------------------
def nano_vllm(
    num_requests: int = NANO_NUM_REQUESTS,
    max_input_len: int = NANO_MAX_LEN,
    max_output_len: int = NANO_MAX_LEN,
    seed: int = 0,
    min_input_len: Optional[int] = None,
    min_output_len: Optional[int] = None,
) -> Workload:
    """nano-vllm's workload, drawn in nano-vllm's order (all prompts, then all max_tokens)."""
    lo_in = scaled_min_len(max_input_len) if min_input_len is None else min_input_len
    lo_out = scaled_min_len(max_output_len) if min_output_len is None else min_output_len
    if num_requests < 1 or not 1 <= lo_in <= max_input_len or not 1 <= lo_out <= max_output_len:
        raise ValueError(
            f"bad workload shape: {num_requests=} input {lo_in}-{max_input_len} output {lo_out}-{max_output_len}"
        )
    rng = random.Random(seed)  # the same stream as random.seed(seed) + the module-level randint
    prompts = [
        [rng.randint(0, NANO_VOCAB_MAX) for _ in range(rng.randint(lo_in, max_input_len))] for _ in range(num_requests)
    ]
    max_tokens = [rng.randint(lo_out, max_output_len) for _ in range(num_requests)]
    w = Workload(NANO_VLLM, prompts, max_tokens)
    w.info = {
        "name": NANO_VLLM,
        "num_requests": num_requests,
        "seed": seed,
        "input_tokens": w.input_tokens,
        "output_tokens": w.output_tokens,
        "input_len_range": _len_range([len(p) for p in prompts]),
        "output_len_range": _len_range(max_tokens),
    }
    return w


def draw_output_len(rng: random.Random, median: float, sigma: float, max_tokens: int) -> int:
    return max(1, min(max_tokens, round(rng.lognormvariate(math.log(median), sigma))))


def early_stop(
    num_requests: int,
    max_input_len: int,
    max_tokens: int,
    output_median: float,
    output_sigma: float = 1.0,
    seed: int = 0,
    min_input_len: Optional[int] = None,
) -> Workload:
    """Prompts in nano-vllm's bounds, then one lognormal output length per request (in that order,
    from `random.Random(seed)` alone); every request asks `max_tokens`."""
    lo = scaled_min_len(max_input_len) if min_input_len is None else min_input_len
    if num_requests < 1 or not 1 <= lo <= max_input_len or max_tokens < 1:
        raise ValueError(f"bad workload shape: {num_requests=} input {lo}-{max_input_len} {max_tokens=}")
    if output_median <= 0 or output_sigma < 0:
        raise ValueError(f"the output lengths need a median > 0 and a sigma >= 0, got {output_median}, {output_sigma}")
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, NANO_VOCAB_MAX) for _ in range(rng.randint(lo, max_input_len))] for _ in range(num_requests)
    ]
    lens = [draw_output_len(rng, output_median, output_sigma, max_tokens) for _ in range(num_requests)]
    w = Workload(EARLY_STOP, prompts, [max_tokens] * num_requests, output_lens=lens)
    outs = sorted(lens)
    w.info = {
        "name": EARLY_STOP,
        "num_requests": num_requests,
        "seed": seed,
        "input_tokens": w.input_tokens,
        "input_len_range": _len_range([len(p) for p in prompts]),
        "max_tokens": max_tokens,
        "output_distribution": {
            "kind": "lognormal",
            "median": output_median,
            "sigma": output_sigma,
            "clamp": [1, max_tokens],
        },
        "output_tokens": w.output_tokens,
        "output_len_mean": statistics.fmean(outs),
        "output_len_median": statistics.median(outs),
        "output_len_p90": percentile(outs, 0.9),
        "output_len_max": outs[-1],
        "requests_at_max_tokens": sum(n == max_tokens for n in outs),
        "output_fraction_of_max_tokens": w.output_tokens / (max_tokens * len(outs)),
        "prompt_lens": [len(p) for p in prompts],
        "output_lens": list(lens),
    }
    return w


def shared_prefix(
    groups: int, group_size: int, prefix_len: int, question_len: int, answer_len: int, vocab: int, seed: int = 0
) -> Workload:
    """`groups` x `group_size` requests: the group's `prefix_len` random token ids, then the request's
    own `question_len`; each generates `answer_len`. Shuffled with `seed`: a group arrives spread out."""
    for name, value in (
        ("groups", groups),
        ("group_size", group_size),
        ("question_len", question_len),
        ("answer_len", answer_len),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be at least 0, got {prefix_len}")
    rng = random.Random(seed)
    high = min(vocab, NANO_VOCAB_MAX) - 1
    requests = []
    for g in range(groups):
        prefix = [rng.randint(0, high) for _ in range(prefix_len)]
        for _ in range(group_size):
            requests.append((g, prefix + [rng.randint(0, high) for _ in range(question_len)]))
    rng.shuffle(requests)
    w = Workload(
        SHARED_PREFIX, [p for _, p in requests], [answer_len] * len(requests), group_of=[g for g, _ in requests]
    )
    w.info = {
        "name": SHARED_PREFIX,
        "groups": groups,
        "group_size": group_size,
        "prefix_len": prefix_len,
        "question_len": question_len,
        "answer_len": answer_len,
        "prompt_tokens": w.input_tokens,
        "output_tokens": w.output_tokens,
        "seed": seed,
    }
    return w


def random_prompts(
    num_prompts: int, min_len: int, max_len: int, output_len: int, seed: int = 0, vocab_size: int = 10000
) -> Workload:
    """Seeded random prompts of token ids in [0, vocab_size), lengths in [min_len, max_len]; each
    request generates exactly output_len tokens."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len=} {max_len=}")
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_prompts)]
    w = Workload("random", prompts, [output_len] * num_prompts)
    w.info = {
        "name": "random",
        "num_requests": num_prompts,
        "seed": seed,
        "input_tokens": w.input_tokens,
        "output_tokens": w.output_tokens,
    }
    return w


def online(
    num: int,
    min_len: int,
    max_len: int,
    output_len: int,
    shared_prefix_len: int = 0,
    prefix_groups: int = 1,
    seed: int = 0,
) -> Workload:
    """Each prompt: its group's shared prefix (request i is in group i % prefix_groups), then a random
    suffix of min_len..max_len tokens."""
    if num < 1 or not 1 <= min_len <= max_len or output_len < 1 or shared_prefix_len < 0 or prefix_groups < 1:
        raise ValueError(
            "need prompts >= 1, 1 <= min_len <= max_len, output_len >= 1, shared_prefix_len >= 0, prefix_groups >= 1"
        )
    rng = random.Random(seed)
    prefixes = [[rng.randrange(*ONLINE_TOKEN_RANGE) for _ in range(shared_prefix_len)] for _ in range(prefix_groups)]
    prompts = []
    for i in range(num):
        suffix = [rng.randrange(*ONLINE_TOKEN_RANGE) for _ in range(rng.randint(min_len, max_len))]
        prompts.append(prefixes[i % prefix_groups] + suffix)
    return Workload(
        "online",
        prompts,
        [output_len] * num,
        group_of=[i % prefix_groups for i in range(num)],
        info={"name": "online", "num_requests": num, "seed": seed},
    )


def warmup(max_input_len: int, n: int = 8, seed: int = 0, max_tokens: int = 8) -> Workload:
    """A few short requests of varied lengths, not prefixes of a workload's (no prefix-cache hits)."""
    rng = random.Random(f"warmup-{seed}")
    top = max(1, min(max_input_len, 256))
    prompts = [[rng.randint(0, NANO_VOCAB_MAX) for _ in range(rng.randint(max(1, top // 8), top))] for _ in range(n)]
    return Workload("warm-up", prompts, [max_tokens] * n)
