"""Which slice of every weight one tensor-parallel rank holds (Megatron-style).

- Attention: query heads are split by KV group, so each rank's query heads read only its own KV
  heads, with the same group size as the whole model (the attention kernels assume a uniform
  grouping). With at least as many KV heads as ranks, the groups are spread as evenly as they go
  (SmolLM2's 3 groups over 2 ranks: 2 and 1). With fewer KV heads than ranks, each KV head is
  replicated on the ranks that share its group, and the group's query heads are split among them.
- MLP: gate and up projections split by column (intermediate features), down by row.
- Embedding and LM head: split by vocabulary row, in equal shards of ceil(vocab / ranks) so the
  LM head's logits gather into one tensor; the last shard may be shorter.
- Norms: replicated.

`take` cuts one of our parameters (engine/model/weights.py names) from anything indexable like a tensor,
so a safetensors slice is read for this rank's part only, never whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List

import torch

from kvledger.engine.model.config import ModelConfig


class PartitionError(ValueError):
    """The model's shapes cannot be split over this many ranks."""


def _even(n: int, parts: int, i: int) -> range:
    return range(n * i // parts, n * (i + 1) // parts)


@dataclass(frozen=True)
class TensorParallelShard:
    rank: int = 0
    size: int = 1

    # -- what this rank holds ------------------------------------------------------------------
    def kv_heads(self, c: ModelConfig) -> range:
        if c.num_kv_heads >= self.size:
            return _even(c.num_kv_heads, self.size, self.rank)
        share = self.size // c.num_kv_heads  # ranks per KV head
        head = self.rank // share
        return range(head, head + 1)

    def heads(self, c: ModelConfig) -> range:
        group = c.num_heads // c.num_kv_heads
        kv = self.kv_heads(c)
        if c.num_kv_heads >= self.size:
            return range(kv.start * group, kv.stop * group)
        share = self.size // c.num_kv_heads
        part = self.rank % share
        per = group // share
        return range(kv.start * group + part * per, kv.start * group + (part + 1) * per)

    def intermediate(self, c: ModelConfig) -> range:
        return _even(c.intermediate_size, self.size, self.rank)

    def vocab_shard_size(self, c: ModelConfig) -> int:
        return -(-c.vocab_size // self.size)

    def vocab(self, c: ModelConfig) -> range:
        per = self.vocab_shard_size(c)
        return range(min(c.vocab_size, self.rank * per), min(c.vocab_size, (self.rank + 1) * per))

    def check(self, c: ModelConfig) -> None:
        """Raise PartitionError naming the shape that does not split over `size` ranks."""
        n = self.size
        if n < 1:
            raise PartitionError(f"tensor_parallel_size must be >= 1, got {n}")
        if n == 1:
            return
        if c.num_heads < n:
            raise PartitionError(f"tensor_parallel_size {n}: the model has only {c.num_heads} attention heads")
        if c.intermediate_size < n or c.vocab_size < n:
            raise PartitionError(f"tensor_parallel_size {n}: more ranks than MLP features or vocabulary rows")
        if c.num_kv_heads < n:
            group = c.num_heads // c.num_kv_heads
            if n % c.num_kv_heads or group % (n // c.num_kv_heads):
                raise PartitionError(
                    f"tensor_parallel_size {n}: {c.num_kv_heads} KV heads of {group} query heads each cannot be "
                    f"shared evenly by {n} ranks (need a multiple of {c.num_kv_heads} that divides "
                    f"{c.num_kv_heads * group} into whole query heads per rank)"
                )

    # -- cutting parameters ----------------------------------------------------------------------
    def take(self, name: str, c: ModelConfig, get: Callable[[], Any]) -> torch.Tensor:
        """This rank's part of parameter `name`; `get()` returns the whole parameter, lazily
        indexable (a tensor, a safetensors slice, or `FusedRows` over separate pieces)."""
        leaf = name.split(".")[-2]  # "layers.3.attn.qkv_proj.weight" -> "qkv_proj"
        d = c.head_dim
        if leaf == "qkv_proj":
            q, kv = self.heads(c), self.kv_heads(c)
            qn, kn = c.num_heads * d, c.num_kv_heads * d
            return _rows(
                get(),
                [
                    (q.start * d, q.stop * d),
                    (qn + kv.start * d, qn + kv.stop * d),
                    (qn + kn + kv.start * d, qn + kn + kv.stop * d),
                ],
            )
        if leaf == "gate_up_proj":
            i, n = self.intermediate(c), c.intermediate_size
            return _rows(get(), [(i.start, i.stop), (n + i.start, n + i.stop)])
        if leaf == "o_proj":
            q = self.heads(c)
            return _tensor(get()[:, q.start * d : q.stop * d])
        if leaf == "down_proj":
            i = self.intermediate(c)
            return _tensor(get()[:, i.start : i.stop])
        if name in ("embed_tokens.weight", "lm_head.weight"):
            v = self.vocab(c)
            return _tensor(get()[v.start : v.stop])
        return _tensor(get()[:])  # norms: every rank holds all of them


class FusedRows:
    """Separate pieces (q, k, v or gate, up) seen as one tensor stacked by rows, for `take`: a row
    range inside one piece reads only that piece's rows."""

    def __init__(self, pieces: List[tuple[Any, int]]) -> None:
        self.pieces = pieces  # (indexable, rows)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start = 0
        for piece, n in self.pieces:
            if start <= rows.start and rows.stop <= start + n:
                return _tensor(piece[rows.start - start : rows.stop - start])
            start += n
        raise IndexError(f"rows {rows.start}:{rows.stop} span two fused pieces")


def _rows(t: Any, ranges: List[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([_tensor(t[a:b]) for a, b in ranges], dim=0)


def _tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
