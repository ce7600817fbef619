import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """A real Ray cluster on this machine (2 CPUs), shared by the tests of this process; the
    executors find it initialized and neither start nor stop it."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
