"""Speculative decoding on the call-level protocol: the driver as drafter and verifier, and the
judge's clauses on what a request holds ahead of its committed KV.

A subject that declares `spec_tokens` K verifies K draft tokens per request at each decode step,
and one that declares `max_ahead` A may hold locations for up to A positions past its last token
(SGLang's decode reserve, vLLM's lookahead slots). The call-level driver (`subject_driver.py`)
hands such a decode here; with K = 0 it never imports this module (Hypothesis reads the literals
of every loaded module: see `drivers.py`), so the other subjects are driven as before.

A speculative decode step, for a request whose tokens are t[0..n) (t[n-1] the last, without KV):

  allocate(uid, n - 1, n + K)         locations for the last token and its K drafts; the subject
                                      may allocate more (its reserve), up to round_up(n + A, page)
  drafted(uid, n, drafts)             the drafter's K tokens for positions [n, n + K)
  (the forward writes KV for t[n-1] and every draft: the Witness records each draft's KV as
   written for its draft prefix, so a location read or cached later for other tokens fails
   7-kv-provenance)
  computed(uid, n - 1, n + m, token)  verification kept the first m drafts: the request's new
                                      tokens are drafts[:m] and then `token` (the bonus sampled
                                      after them, or the m-th draft when max_tokens cuts the run
                                      short); positions [n - 1, n + m) hold its KV, committed
  rejected(uid, n + m, n + K)         (optional: only a subject that defines it) positions whose
                                      KV belongs to drafts verification threw away; the subject
                                      may roll them back or keep the slots for the next step

The drafts and the bonus come from the operation's `sample` (cycled: each request's K drafts,
then its bonus), how many drafts are kept from its `accept` (cycled, per request in batch
order; none: every draft rejected). A bonus equal to the first rejected draft is bumped by one:
the model disagreed with that draft.

What the judge adds for such subjects, each by its own arithmetic over the View and the driver's
counts (`committed` is what the driver handed back through `computed`, the Witness's count):

  8-request          committed <= allocated: a request holds locations for every position it
                     computed (the judge's existing clause), and after `allocate` returned True for
                     [n - 1, n + K) it holds all of them (the driver's check before `computed`)
  11-over-allocation its tail, positions [committed, allocated), is its own: no cache entry and no
                     other live request holds a location of it (the tree owns a prefix of committed
                     KV, never a slot ahead of it); and when the request ends (finish, abort,
                     preempt) every page of the tail past the page of its committed KV is free
                     after the call: a release returns the whole over-allocation
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Set, Tuple

from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.invariants import InvariantViolation
from kvledger.engine.ledger.ops import OpResult
from kvledger.properties.subject import GroupView, View
from kvledger.properties.subject_calls import call_subject
from kvledger.properties.subject_events import EXHAUSTED_AT_DECODE, ahead_of_tokens, pool_exhausted

__all__ = ["check_tail", "released", "speculative_decode"]

REJECTED = "spec: a draft rejected"
ALL_ACCEPTED = "spec: every draft accepted"
AHEAD = "ahead: a request holds slots past its tokens"


def _token(sample: Sequence[int], n: int) -> int:
    return int(sample[n % len(sample)]) if sample else 0


def speculative_decode(driver: Any, sample: Sequence[int], stop: Sequence[int], accept: Sequence[int]) -> OpResult:
    """One decode step of a subject that speculates, driven by `driver` (a `SubjectDriver`)."""
    k = driver.caps.spec_tokens
    driver.victims = []
    exhausted = driver.check and pool_exhausted(driver.view(), driver.caps.page_size)
    batch: List[Tuple[int, int, int]] = []
    for uid in list(driver.running):
        if uid not in driver.running:  # preempted by an earlier request's allocation
            continue
        n = len(driver.witness.tokens[uid])
        if driver._allocate(uid, n - 1, n + k) and uid in driver.running:
            batch.append((uid, n - 1, n + k))
    if exhausted and driver.victims:  # the step needed room on a pool with none free or evictable
        driver.on_event(EXHAUSTED_AT_DECODE)
    batch = [(u, a, b) for u, a, b in batch if u in driver.running]
    _verify(driver, batch, sample, stop, accept)
    return OpResult(batch=tuple(u for u, _, _ in batch), preempted=driver._victims())


def _verify(
    driver: Any, batch: List[Tuple[int, int, int]], sample: Sequence[int], stop: Sequence[int], accept: Sequence[int]
) -> None:
    """The forward pass over the batch (KV for each last token and its drafts), verification, and
    the results in batch order; then the requests that ended are finished."""
    if not batch:
        return
    witness, k = driver.witness, driver.caps.spec_tokens
    view = driver.view()
    rows = {uid: list(view.requests.get(uid, [])) for uid, _, _ in batch}
    groups = [GroupView(g.name, g.window, {u: list(g.requests.get(u, [])) for u in rows}) for g in view.groups]
    written = View(free=[], requests=rows, groups=groups)
    if driver.caps.max_ahead and ahead_of_tokens(view, witness, driver.caps.page_size):
        driver.on_event(AHEAD)
    drawn = 0
    ending: List[int] = []
    for i, (uid, start, end) in enumerate(batch):
        tokens = witness.tokens[uid]
        if len(rows[uid]) < end:
            raise Finding(
                "8-request",
                f"uid {uid} was allocated positions [{start}, {end}) (its last token and {k} drafts) "
                f"but the subject shows locations for {len(rows[uid])}",
            )
        drafts = [_token(sample, drawn + j) for j in range(k)]
        bonus = _token(sample, drawn + k)
        drawn += k + 1
        m = min(int(accept[i % len(accept)]) if accept else 0, k)
        driver.on_event(ALL_ACCEPTED if m == k else REJECTED)
        if m < k and bonus == drafts[m]:
            bonus += 1  # the model disagrees with the first rejected draft
        call_subject("drafted", driver.subject.drafted, uid, start + 1, list(drafts))
        witness.wrote_view(written, uid, tokens + drafts, start, end)
        room = driver.max_tokens[uid] - (len(tokens) - witness.prompt_len[uid])
        out = (drafts[:m] + [bonus])[:room]
        kept = start + len(out)
        call_subject("computed", driver.subject.computed, uid, start, kept, out[-1])
        if kept < end and hasattr(driver.subject, "rejected"):
            call_subject("rejected", driver.subject.rejected, uid, kept, end)
        tokens.extend(out)
        witness.computed[uid] = kept
        if len(out) == room or uid in stop:
            ending.append(uid)
    for uid in ending:
        driver._end(uid)


def check_tail(view: View, computed: Dict[int, int]) -> None:
    """Each live request's positions past its committed KV are its own: no cache entry holds one
    of their locations, nor does another live request's row."""
    cached: Dict[int, str] = {}
    for n, entry in enumerate(view.cached):
        if entry.group == 0:
            for loc in entry.locations:
                cached[int(loc)] = entry.name or f"entry {n}"
    owners: Dict[int, Set[int]] = {}
    for uid, row in view.requests.items():
        for loc in row:
            owners.setdefault(int(loc), set()).add(uid)
    for uid in sorted(computed):
        row = view.requests.get(uid, [])
        for pos in range(computed[uid], len(row)):
            loc = int(row[pos])
            if loc in cached:
                raise InvariantViolation(
                    "11-over-allocation",
                    f"uid {uid} committed {computed[uid]} positions, but position {pos} of its tail (held "
                    f"ahead, not yet verified) is at location {loc}, which cache {cached[loc]} holds: the "
                    "prefix cache owns committed KV only",
                )
            others = sorted(owners.get(loc, set()) - {uid})
            if others:
                raise InvariantViolation(
                    "11-over-allocation",
                    f"uid {uid} committed {computed[uid]} positions, but position {pos} of its tail is at "
                    f"location {loc}, which uids {others} hold too: a slot held ahead is the request's own",
                )


def tail_pages(row: Sequence[int], committed: int, page_size: int) -> List[int]:
    """The pages of `row` past the page holding position committed - 1 (the over-allocated tail)."""
    first = -(-committed // page_size) * page_size
    return sorted({int(loc) // page_size for loc in row[first:]})


def released(driver: Any, uid: int, how: str, before: View, committed: int) -> None:
    """After `uid` ended (`how`: finish, abort or preempt), every page of the tail it held is free."""
    ps = driver.caps.page_size
    tail = tail_pages(before.requests.get(uid, []), committed, ps)
    if not tail:
        return
    free = set(map(int, driver.view().free))
    kept = [p for p in tail if p not in free]
    if kept:
        raise Finding(
            "11-over-allocation",
            f"uid {uid} held pages {tail} past its committed KV ({committed} positions) and was released "
            f"({how}), but pages {kept} are not free after it: the over-allocated tail is not returned",
        )
