"""The decode kernel's launch order (`longest_first`): the longest requests' programs start first.
Which program runs when cannot change an output (tests/engine/attention/test_triton_paged.py checks
that on CUDA); what this pins is the order itself, which decides whether a long request's programs
are left running alone at the end of a launch."""

import torch

from kvledger.engine.attention.triton_decode import longest_first


def test_longest_first_is_a_permutation_by_descending_length():
    g = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(1, 3000, (257,), generator=g, dtype=torch.int32)
    order = longest_first(seq_lens)
    assert order.dtype == torch.int32
    assert sorted(order.tolist()) == list(range(len(seq_lens)))
    lens = seq_lens[order.long()]
    assert bool((lens[:-1] >= lens[1:]).all())
    assert int(lens[0]) == int(seq_lens.max())
