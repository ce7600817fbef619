"""The model runner: one batch's forward pass over the page table, eager or as a CUDA graph.

Decode input tokens never leave the device: `next_tokens` holds, per table row, the token its
request feeds to the next decode step (the greedy token the previous step left there, or the
CPU sampler's). Decode batches that fit a captured size replay a graph (`cuda_graphs.py`); every
other batch runs eagerly with attention metadata built from the page table.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from kvledger.engine.attention.base import AttentionBatch
from kvledger.engine.model.model import CausalLM
from kvledger.engine.runtime.cuda_graphs import DecodeGraphs
from kvledger.engine.runtime.scheduler import Batch

MAX_GRAPH_BATCH = 256


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        page_table: torch.Tensor,
        max_running_req: int,
        device: torch.device,
        cuda_graphs: bool = True,
    ) -> None:
        self.model = model
        self.page_table = page_table
        self.device = device
        # per table row, the token its request feeds to the next decode step (last entry: scratch)
        self.next_tokens = torch.zeros(max_running_req + 1, dtype=torch.long, device=device)
        self.graphs: Optional[DecodeGraphs] = None
        if cuda_graphs and device.type == "cuda" and model.uses_fused_path():
            self.graphs = DecodeGraphs(model, page_table, self.next_tokens, min(max_running_req, MAX_GRAPH_BATCH))

    def capture_graphs(self) -> None:
        """Capture the decode CUDA graphs (needs model.kv_pool); a no-op without graphs."""
        if self.graphs is not None and not self.graphs.graphs:
            self.graphs.capture()

    def forward(self, batch: Batch, may_share: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        """Run the model; returns (logits, greedy tokens) of the sampled rows, on the device. The
        tokens are also left in next_tokens for the next decode step. may_share: whether running
        requests may share KV pages (cascade attention)."""
        reqs = batch.requests
        rows = [r.table_idx for r in reqs]
        if batch.phase == "decode" and self.graphs is not None and self.graphs.fits(len(reqs)):
            return self.graphs.run(rows, [r.device_len for r in reqs], cascade=may_share)
        attn = AttentionBatch.from_page_table(
            self.page_table, rows, [r.cached_len for r in reqs], [r.device_len for r in reqs]
        )
        attn.may_share = may_share
        table_rows = attn.rows
        assert table_rows is not None  # from_page_table sets them
        if batch.phase == "decode":
            ids = self.next_tokens[table_rows]  # the previous step's tokens, still on the device
        else:
            ids = torch.cat([r.input_ids[r.cached_len : r.device_len] for r in reqs])
            ids = ids.pin_memory() if self.device.type == "cuda" else ids
            ids = ids.to(self.device, torch.long, non_blocking=True)
        logits = self.model(ids, attn.positions, attn)
        if len(batch.sampled) != len(reqs):
            keep = torch.tensor(batch.sampled, dtype=torch.long, device=self.device)
            logits = logits[keep]
            sampled_rows = table_rows[keep]
        else:
            sampled_rows = table_rows
        tokens = logits.argmax(-1)
        self.next_tokens[sampled_rows] = tokens
        return logits, tokens

    def set_next_tokens(self, rows: Sequence[int], tokens: List[int]) -> None:
        """Tokens the CPU sampler chose replace the greedy ones for the next decode step."""
        index = torch.tensor(list(rows), device=self.device)
        self.next_tokens[index] = torch.tensor(tokens, device=self.device)
