"""A real Ray cluster fixture for the campaign tests. tests/conftest.py imports it once: a fixture
defined in two conftests is two session fixtures, and the second would start Ray again in the same
process."""

import os

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """A real Ray cluster on this machine (2 CPUs), shared by the tests of this process; the
    executors find it initialized and neither start nor stop it."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no report to Ray's servers from a test
    # a small object store: the tasks pass a few kilobytes, and /dev/shm may be small on CI machines
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=200 * 2**20)
    yield ray
    ray.shutdown()
