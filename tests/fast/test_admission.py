"""fast's admission (fast/admission.py): the decode manager drops requests that cannot decode, and
the pages reserved per request are exactly what the admission policy says in tokens."""

# Mutation killers (`kvledger mutation`, properties/mutation.toml; results/mutation/README.md lists
# what survives): the lockstep run cannot see a mutant of code both sides share, of a check a correct
# run never trips, or of arithmetic that differs only on inputs the generators never draw (page sizes
# that are not powers of two, token ids above 256, uids that are not small ints). Each test here pins
# one of those down with numbers worked out by hand.

from __future__ import annotations

import pytest

from kvledger import fast
from kvledger.reference.admission_policy import AdmissionPolicy
from tests.support.ledger import sched


def test_decode_manager_drops_requests_that_cannot_decode():
    s = sched(fast)
    s.submit(0, [1, 2], 1)  # ends with its first sampled token
    s.submit(1, [3, 4], 3)
    batch, _ = s.admit(64)
    for req in batch:
        req.complete_one()
        req.append_host(0)
    dm = fast.DecodeManager(1)
    dm.running_reqs.add(batch[0])  # it ended: filtering drops it
    dm.filter_reqs(batch[1:])
    assert dm.running_reqs.uids() == [1]


@pytest.mark.parametrize("page_size", [1, 2, 3, 4])
@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.25, 1 / 3, 0.5, 0.7, 0.999999, 1.0])
def test_fast_reserves_what_the_policy_says(page_size, ratio):
    from kvledger.fast.admission import _reserved_pages

    for kind in ("reserve", "optimistic"):
        policy = AdmissionPolicy("".join(kind), ratio)  # a kind built at run time, as a parsed one is
        for max_len in range(1, 14):
            for device_len in range(0, max_len + 1):
                for cached_len in range(0, max_len + 1):
                    want = policy.reserved_tokens(cached_len, device_len, max_len, page_size)
                    got = _reserved_pages(policy, cached_len, device_len, max_len, page_size) * page_size
                    assert got == want, (kind, ratio, cached_len, device_len, max_len, page_size)
