"""Per-request sampling: greedy, temperature, top-k, top-p, each request with its own seeded
generator so a run replays identically whatever else is in the batch."""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from fast import SamplingParams


def validate_sampling(params: SamplingParams) -> None:
    """A ValueError naming the bad field."""
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k == 0 or params.top_k < -1:
        raise ValueError(f"top_k must be -1 (off) or >= 1, got {params.top_k}")
    if params.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, -1) >= top_p  # keep the token crossing top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


class Sampler:
    def __init__(self, base_seed: int = 0) -> None:
        self.base_seed = base_seed
        self._generators: Dict[int, torch.Generator] = {}

    def add(self, uid: int, params: SamplingParams) -> None:
        seed = params.seed if params.seed is not None else self.base_seed * 1_000_003 + uid
        self._generators[uid] = torch.Generator().manual_seed(seed)

    def remove(self, uid: int) -> None:
        self._generators.pop(uid, None)

    def sample(self, logits: torch.Tensor, uids: Sequence[int], params: Sequence[SamplingParams]) -> List[int]:
        """logits [B, vocab] float32 (any device) -> one token per row."""
        tokens = torch.argmax(logits, dim=-1).tolist()
        for i, (uid, p) in enumerate(zip(uids, params)):
            if p.is_greedy:
                continue
            # a vanishing temperature would overflow the logits: treat it as the smallest sane one
            row = _filter_top_k_top_p(logits[i].float().cpu() / max(p.temperature, 1e-5), p.top_k, p.top_p)
            probs = torch.softmax(row, -1)
            tokens[i] = int(torch.multinomial(probs, 1, generator=self._generators[uid]))
        return tokens
