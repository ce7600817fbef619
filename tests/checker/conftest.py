from tests.support.ray_cluster import ray_cluster  # noqa: F401
