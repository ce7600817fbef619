"""Fixtures and hooks for the whole suite. Helpers that test modules import live in tests/support/
(`from tests.support.impls import as_list`); no test module imports another."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its thread pool

import importlib.util  # noqa: E402

import torch  # noqa: E402

if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    # Triton kernels decide at definition whether they are interpreted: before any test imports them
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kvledger.properties.profiles import register_profiles  # noqa: E402
from kvledger.reference import events  # noqa: E402
from tests.support.impls import IMPLS  # noqa: E402
from tests.support.ray_cluster import ray_cluster  # noqa: E402, F401 (one session fixture)

register_profiles()  # ci, deep, dev; loads $HYPOTHESIS_PROFILE (default ci)


@pytest.fixture(params=sorted(IMPLS))
def impl(request):
    """Run the test once against the model and once against the tensor implementation."""
    return IMPLS[request.param]


@pytest.fixture
def noted():
    """The rare-branch notes (kvledger.reference.events) emitted during the test, in order."""
    seen = []
    events.set_listener(seen.append)
    yield seen
    events.set_listener(None)


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.cuda` (or `cuda(devices=N)`): skipped, with the reason, where this machine has
    fewer CUDA devices than the test needs. The one place that decides it: no per-file skipif."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("cuda")
        if marker is None:
            continue
        need = marker.kwargs.get("devices", 1)
        if have < need:
            reason = "no CUDA device" if need == 1 else f"needs {need} CUDA devices, this machine has {have}"
            item.add_marker(pytest.mark.skip(reason=reason))
