"""Which executor a campaign runs on: worker processes here, or a Ray cluster. Its own module so
that neither executor imports the other."""

from __future__ import annotations

from typing import Optional

from kvledger.campaign.executor import Executor, LocalExecutor


def executor_for(cluster: Optional[str], workers: int = 1) -> Executor:
    """`cluster`: None for worker processes here, else a Ray address (`auto`: the cluster this
    machine belongs to; `local`: start one on this machine for the campaign)."""
    if cluster is None:
        return LocalExecutor(workers)
    from kvledger.campaign.ray_executor import RayExecutor

    return RayExecutor(cluster, num_cpus=workers if cluster == "local" else None)
