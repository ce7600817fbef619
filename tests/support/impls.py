"""The two implementations of the cache manager, and helpers that read either one's state.

The `impl` fixture (tests/conftest.py) runs a test once per entry of IMPLS. The reference keeps
lists, fast keeps tensors: `as_list` and `row` read either as plain lists."""

from kvledger import fast, reference

IMPLS = {"reference": reference, "fast": fast}


def make_manager(impl, *, num_pages, page_size, cache="naive", rows=4, max_seq_len=64):
    page_table = impl.make_page_table(rows, max_seq_len)
    cm = impl.CacheManager(num_pages, page_size, page_table, cache)
    return cm, impl.TableManager(rows, page_table)


def row(impl, cm, idx, end):
    values = cm.page_table[idx][:end]
    return values.tolist() if hasattr(values, "tolist") else list(values)


def as_list(x):
    return x.tolist() if hasattr(x, "tolist") else list(x)
