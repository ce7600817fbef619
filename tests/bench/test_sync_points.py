"""The sync-point counter (kvledger.bench.sync_points) counts PyTorch's sync-debug warnings by the
package's own call sites and lets every other warning through (its CUDA run is the device's)."""

from __future__ import annotations

import warnings

import torch

from kvledger.bench import sync_points
from kvledger.engine.ledger.invariants import tolist


def test_each_synchronizing_call_is_counted_by_the_package_frames_that_made_it(monkeypatch):
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    seen = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *a, **k: seen.append(str(message)))

    def sync_in_tolist(x):  # stands in for PyTorch's warning from inside a package call
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=2)
        return x

    with sync_points.SyncCounter() as counter:
        for _ in range(3):
            tolist(sync_in_tolist([1, 2]))
            tolist(_SyncingList([3]))
        warnings.warn("something else", UserWarning, stacklevel=2)
    assert modes == ["warn", "default"]
    assert seen == ["something else"]  # passed through, not counted
    assert sum(counter.sites.values()) == 6
    (site,) = [s for s in counter.sites if any("invariants.py" in f for f in s)]
    assert counter.sites[site] == 3 and site[0].startswith("invariants.py:") and site[0].endswith(" tolist")


class _SyncingList(list):
    def tolist(self):
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=2)
        return list(self)
