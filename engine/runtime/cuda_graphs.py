"""CUDA graphs of the decode step, one per padded batch size up to `max_batch`.

A captured step reads everything from device buffers: the batch's table rows and sequence
lengths (one small pinned host-to-device copy per step), the request-to-token table, and the
per-row token buffer where the previous step's sampler left each request's next input token.
Inside the graph: positions and KV locations come from the table, the model runs (fused Triton
path), greedy tokens are taken, and written back into the token buffer for the next step, so a
decode step needs nothing from the host but the metadata and nothing goes back but the tokens.

Padded rows (batch sizes are rounded up to a captured size) read table row 0, write their K/V to
the pool's scratch location and their token to the scratch entry of the token buffer: nothing a
live request owns is touched.

With cascade attention (a backend whose `cascade` is set) every size is captured twice, with and
without it: a step where no running request came with a cached prefix shares no pages, and
replays the plain graph, free of the grouping and prefix kernels.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

from kvledger.engine.attention.triton_decode import num_splits_for


def step_metadata(rows: Sequence[int], seq_lens: Sequence[int], batch_size: int) -> np.ndarray:
    """[3, batch_size] int64: each row's table row, sequence length and whether it is real. Padded
    rows read table row 0 with length 1 and are not real (their K/V and token go to scratch).
    Filled through numpy, which is cheaper per step than `torch.tensor` over three Python lists
    (measured: notes/gpu-speed.md, "GPU speed round 3, second session")."""
    n = len(rows)
    meta = np.zeros((3, batch_size), dtype=np.int64)
    meta[0, :n] = rows
    meta[1, :n] = seq_lens
    meta[1, n:] = 1
    meta[2, :n] = 1
    return meta


def graph_batch_sizes(max_batch: int) -> List[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, model, table: torch.Tensor, next_tokens: torch.Tensor, max_batch: int) -> None:
        """table: [rows, width] int32 token locations; next_tokens: [rows + 1] int64, the last
        entry is scratch for padded rows."""
        self.model = model
        self.table = table
        self.next_tokens = next_tokens
        self.scratch_row = next_tokens.numel() - 1
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        device = table.device
        self.meta = torch.zeros(3, self.max_batch, dtype=torch.int64, device=device)  # rows, seq_lens, valid
        self.graphs: Dict[Tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (batch size, cascade)
        self.outputs: Dict[Tuple[int, bool], Tuple[torch.Tensor, torch.Tensor]] = {}
        self._kv_heads = model.config.num_kv_heads
        self.variants = (False, True) if getattr(model.attn_backend, "cascade", False) else (False,)

    def capture(self) -> None:
        """Capture every size, largest first so the smaller graphs reuse its memory pool."""
        self.meta[1].fill_(1)
        pool = None
        for bs in reversed(self.sizes):
            for cascade in self.variants:
                self._body(bs, cascade)  # warm-up: compiles the Triton kernels, settles the allocator
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs, cascade] = self._body(bs, cascade)
                pool = graph.pool()
                self.graphs[bs, cascade] = graph
        torch.cuda.synchronize()

    def _body(self, bs: int, cascade: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        rows, seq_lens, valid = self.meta[0, :bs], self.meta[1, :bs], self.meta[2, :bs].bool()
        positions = seq_lens - 1
        pool = self.model.kv_pool
        out_loc = torch.where(valid, self.table[rows, positions].long(), pool.scratch_loc)
        token_rows = torch.where(valid, rows, self.scratch_row)
        input_ids = self.next_tokens[token_rows]
        self.model.attn_backend.plan_decode(
            self.table, rows, seq_lens, num_splits_for(bs, self._kv_heads), cascade=cascade
        )
        logits = self.model.run(input_ids, positions, out_loc, None, float_logits=False)
        tokens = logits.argmax(-1)
        self.next_tokens[token_rows] = tokens
        return logits, tokens

    def fits(self, batch_size: int) -> bool:
        return 0 < batch_size <= self.max_batch and bool(self.graphs)

    def run(
        self, rows: Sequence[int], seq_lens: Sequence[int], cascade: bool = True
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Replay the graph for this batch: (logits [B, vocab] in the model's dtype, greedy tokens [B]) on the
        device, valid until the next replay. cascade=False: no row shares pages with another."""
        n = len(rows)
        bs = next(s for s in self.sizes if s >= n)
        # a fresh pinned block each step: the caching host allocator reuses it only once the copy is done
        host = torch.from_numpy(step_metadata(rows, seq_lens, bs)).pin_memory()
        self.meta[:, :bs].copy_(host, non_blocking=True)
        key = (bs, cascade and len(self.variants) > 1)
        self.graphs[key].replay()
        logits, tokens = self.outputs[key]
        return logits[:n], tokens[:n]
