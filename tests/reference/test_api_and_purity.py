"""reference and fast expose the same public names and signatures; reference never imports torch."""

import inspect
import subprocess
import sys

from kvledger import fast, reference


def test_same_public_names():
    assert sorted(reference.__all__) == sorted(fast.__all__)


SEED_PRIVATE = {"_allocate", "_free", "_try_allocate_one", "_add_one_req"}  # named by the seed


def _public_methods(cls):
    return {n: m for n, m in inspect.getmembers(cls) if (not n.startswith("_") or n in SEED_PRIVATE) and callable(m)}


def test_same_signatures():
    for name in reference.__all__:
        ref, fst = getattr(reference, name), getattr(fast, name)
        if not inspect.isclass(ref):
            assert list(inspect.signature(ref).parameters) == list(inspect.signature(fst).parameters), name
            continue
        ref_methods = _public_methods(ref)
        for method, fn in ref_methods.items():
            other = getattr(fst, method, None)
            assert other is not None, f"fast.{name} lacks {method}"
            if inspect.isfunction(fn):
                ref_params = [p for p in inspect.signature(fn).parameters if p != "device"]
                fast_params = [p for p in inspect.signature(other).parameters if p != "device"]
                assert ref_params == fast_params, f"{name}.{method}: {ref_params} vs {fast_params}"


def test_constructor_signatures_are_the_seeds():
    assert list(inspect.signature(fast.CacheManager).parameters) == ["num_pages", "page_size", "page_table", "type"]
    assert list(inspect.signature(fast.Req).parameters) == [
        "input_ids",
        "table_idx",
        "cached_len",
        "output_len",
        "uid",
        "sampling_params",
        "cache_handle",
    ]


def test_reference_imports_no_torch():
    code = (
        "import sys, kvledger.reference, kvledger.engine.ledger.cache_scheduler; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
