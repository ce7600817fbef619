"""What a decode graph replay reads from the host (`step_metadata`): the padded rows must read
table row 0 with length 1 and be marked not real, or their K/V and tokens land in a live
request's pages (the graph writes them to scratch only for rows marked not real)."""

import numpy as np

from kvledger.engine.runtime.cuda_graphs import graph_batch_sizes, step_metadata


def test_real_rows_then_padding():
    meta = step_metadata([5, 2, 9], [17, 1, 300], 4)
    assert meta.dtype == np.int64 and meta.shape == (3, 4)
    assert meta[0].tolist() == [5, 2, 9, 0]
    assert meta[1].tolist() == [17, 1, 300, 1]
    assert meta[2].tolist() == [1, 1, 1, 0]


def test_a_full_batch_has_no_padding_and_sizes_cover_every_batch():
    sizes = graph_batch_sizes(256)
    for n in (1, 3, 16, 17, 255, 256):
        bs = next(s for s in sizes if s >= n)
        meta = step_metadata(list(range(n)), [n] * n, bs)
        assert meta[2].sum() == n and (meta[1, n:] == 1).all() and (meta[0, n:] == 0).all()
    assert step_metadata(list(range(16)), [3] * 16, 16)[2].tolist() == [1] * 16
