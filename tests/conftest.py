import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its thread pool

import importlib.util  # noqa: E402

import torch  # noqa: E402

if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    # Triton kernels decide at definition whether they are interpreted: before any test imports them
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from kvledger import fast
from kvledger import reference
from kvledger.properties.profiles import register_profiles

register_profiles()  # ci, deep, dev; loads $HYPOTHESIS_PROFILE (default ci)

IMPLS = {"reference": reference, "fast": fast}


@pytest.fixture(params=sorted(IMPLS))
def impl(request):
    """Run the test once against the model and once against the tensor implementation."""
    return IMPLS[request.param]


def make_manager(impl, *, num_pages, page_size, cache="naive", rows=4, max_seq_len=64):
    page_table = impl.make_page_table(rows, max_seq_len)
    cm = impl.CacheManager(num_pages, page_size, page_table, cache)
    return cm, impl.TableManager(rows, page_table)


def row(impl, cm, idx, end):
    values = cm.page_table[idx][:end]
    return values.tolist() if hasattr(values, "tolist") else list(values)


def as_list(x):
    return x.tolist() if hasattr(x, "tolist") else list(x)
