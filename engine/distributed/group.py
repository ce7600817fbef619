"""The collectives a tensor-parallel model and its replicated scheduler need, over torch.distributed.

Two process groups: the device group (NCCL on CUDA, gloo on the CPU) carries the model's
all-reduces and the LM head's gather; a gloo group carries the scheduler's control messages
(pickled Python objects), which NCCL could only send through device tensors. With one rank,
every collective is the identity and no process group exists.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from kvledger.engine.distributed.partition import TensorParallelShard

log = logging.getLogger(__name__)

# a rank that died is noticed by its peers' next collective (gloo: the socket closes), one that
# stopped by rank 0's liveness watch (rank_watch.py), which kills it; this bounds the wait where no
# watch runs (torchrun across hosts). Not shorter: a rank other than 0 waits in a collective for
# rank 0's next step for as long as the server is idle.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


class TensorParallelGroup:
    def __init__(self, rank: int = 0, size: int = 1, device_group: Any = None, control_group: Any = None) -> None:
        self.rank, self.size = rank, size
        self.shard = TensorParallelShard(rank, size)
        self._device_group = device_group
        self._control_group = control_group
        # rank 0: set (from the liveness watch's thread) once a rank failed or was lost; the engine
        # then stops at its next step, idle or not (engine/distributed/rank_watch.py)
        self.failure: Optional[BaseException] = None
        self.leaving = False  # rank 0 told the other ranks to shut down: their exits are no loss

    @classmethod
    def connect(
        cls, rank: int, size: int, device: torch.device, init_method: str, timeout: datetime.timedelta = DEFAULT_TIMEOUT
    ) -> TensorParallelGroup:
        """Join the world of `size` ranks (the default process group) and build the two groups."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
        control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
        log.info("rank %d of %d joined (%s)", rank, size, backend)
        return cls(rank, size, dist.group.WORLD, control)

    @property
    def distributed(self) -> bool:
        return self.size > 1

    # -- the model's collectives -------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (the output of a row-split matmul)."""
        if self.size > 1:
            dist.all_reduce(x, group=self._device_group)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[T, shard] logits of this rank's vocabulary rows -> [T, vocab] on every rank."""
        if self.size == 1:
            return logits
        per = -(-vocab_size // self.size)  # TensorParallelShard.vocab_shard_size
        if logits.shape[-1] < per:  # the last shard is shorter: pad, gather, cut
            logits = torch.nn.functional.pad(logits, (0, per - logits.shape[-1]))
        parts = torch.empty((self.size,) + tuple(logits.shape), dtype=logits.dtype, device=logits.device)
        _all_gather_single(parts, logits.contiguous(), self._device_group)
        return parts.permute(1, 0, 2).reshape(logits.shape[0], self.size * per)[:, :vocab_size]

    # -- the scheduler's control messages ----------------------------------------------------------
    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self._control_group)
        return box[0]

    def all_gather(self, obj: Any) -> List[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        out: List[Optional[Any]] = [None] * self.size
        dist.all_gather_object(out, obj, group=self._control_group)
        return out

    def abort(self) -> None:
        """Break this rank out of a collective a dead peer will never join (best effort)."""
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception as e:  # no such hook in this torch, or already torn down
            log.debug("abort: %s", e)

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    gather = getattr(dist, "all_gather_single", None)  # torch >= 2.13; all_gather_into_tensor before
    if gather is None:
        gather = dist.all_gather_into_tensor
    gather(out.view(-1), inp.view(-1), group=group)
