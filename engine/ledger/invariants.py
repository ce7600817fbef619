"""The invariants, judged from first principles after every cache operation.

The judge reads raw state only (the free list, the prefix cache's nodes, page-table rows, the
token pool, each live request's lengths) and does its own arithmetic: it calls no method of the
implementation it judges, so a bug in, say, the worst-case page count or the partition check
cannot also blind its judge. What it proves, per implementation (`reference` or `fast`):

  5-quiescence    with no live request, no prefix-cache node is locked (judged first)
  1-2-partition   every page has exactly one owner: the free list, one cache node, or one live
                  request (its pages past its locked prefix); a request's row starts with the
                  locations of the prefix it locked, and is page-contiguous; each node's lock
                  count is the number of live requests whose locked prefix runs through it
  8-request       each live request matches what was submitted: its tokens start with the
                  prompt, max_device_len = prompt + max_tokens, it generated no more than that,
                  its lengths are ordered, and its token-pool row holds its admitted tokens
  3-no-oom        reserve: the worst case of every live request fits what is available;
                  optimistic: each request alone fits the pool (preemption relies on it)
  7-kv-provenance every KV location a live request or the prefix cache points at, below what
                  is computed, was filled by a forward pass over exactly that request's (or
                  that cache path's) tokens up to its position
Invariants 4 (a turned-away request changes nothing) and 6 (preemption takes the newest live
requests) concern one operation, and are checked where it happens (`cache_scheduler.py`).
"""

from __future__ import annotations

from typing import Any, Container, Dict, Iterable, List, Sequence, Tuple

import numpy as np


class InvariantViolation(AssertionError):
    def __init__(self, invariant: str, message: str) -> None:
        super().__init__(f"[{invariant}] {message}")
        self.invariant = invariant


def tolist(x: Any) -> List[int]:
    return x.tolist() if hasattr(x, "tolist") else list(x)


def _array(x: Any) -> np.ndarray:
    """An int64 numpy copy of a list, numpy array or (CPU or CUDA) tensor of ints."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.int64).reshape(-1)


def _pages(tokens: int, page_size: int) -> int:
    """Pages that positions [0, tokens) touch."""
    return (tokens + page_size - 1) // page_size if tokens > 0 else 0


# -- KV provenance ----------------------------------------------------------------------------
_ROOT_HASH = 0x6B766C6564676572  # the hash of the empty prefix ("kvledger")


def extend_hash(prefix_hash: int, token: int) -> int:
    """The hash of a token prefix extended by one token. Python hashes tuples of ints the same
    in every process (PYTHONHASHSEED salts only str and bytes), so traces replay identically."""
    return hash((prefix_hash, int(token)))


def prefix_hashes(tokens: Iterable[int], start: int = _ROOT_HASH) -> List[int]:
    """hashes[i] identifies tokens[: i + 1]: what the KV at position i encodes."""
    out, h = [], start
    for t in tokens:
        h = extend_hash(h, t)
        out.append(h)
    return out


class KVProvenance:
    """What each KV location encodes: the hash of the token prefix ending at its position,
    written when a forward pass fills it (a location never written maps to nothing)."""

    def __init__(self) -> None:
        self.at: Dict[int, int] = {}

    def written(self, locations: Sequence[int], tokens: Sequence[int], start: int) -> None:
        """A forward pass computed positions [start, start + len(locations)) of `tokens`."""
        hashes = prefix_hashes(tokens[: start + len(locations)])
        for i, loc in enumerate(locations):
            self.at[loc] = hashes[start + i]

    def check(self, who: str, locations: Sequence[int], hashes: Sequence[int], start: int = 0) -> None:
        for i, loc in enumerate(locations):
            found = self.at.get(loc)
            if found != hashes[i]:
                what = "was never computed" if found is None else "holds KV computed for other tokens"
                raise InvariantViolation(
                    "7-kv-provenance", f"{who}: position {start + i} points at location {loc}, which {what}"
                )


# -- the judge ----------------------------------------------------------------------------------
def judge(sched: Any) -> None:
    """Every invariant of one implementation's state, from raw state (see the module doc)."""
    live = list(sched.live.values())
    cm = sched.cm
    nodes = list(cm.prefix_cache.nodes())
    if not live:
        locked = [n.id for n in nodes if n.ref_count]
        if locked:
            raise InvariantViolation("5-quiescence", f"no live request, but cache nodes {locked} are locked")
    rows = {r.uid: tolist(sched.page_table[r.table_idx]) for r in live}
    paths = _check_partition(sched, live, nodes, rows)
    for req in live:
        _check_request(sched, req)
    _check_no_oom(sched, live, nodes)
    if sched.provenance is not None:
        _check_provenance(sched.provenance, live, nodes, rows, paths)


def _check_partition(
    sched: Any, live: List[Any], nodes: List[Any], rows: Dict[int, List[int]]
) -> Dict[int, Tuple[List[int], List[int]]]:
    """Returns, per node id, the token and location path from the root to the node's end.

    The claims are counted with numpy: the engine judges an idle pool of a million pages at the
    end of every run, where a Python loop per page took most of a second. The owners of a page
    are listed one by one only once a count is wrong, to name them."""
    cm, ps, num_pages = sched.cm, sched.page_size, sched.num_pages
    claims: List[Tuple[np.ndarray, str]] = []

    def claim(locations: Any, who: str) -> None:
        locs = np.asarray(locations, dtype=np.int64).reshape(-1)
        bad = (locs % ps != 0) | (locs < 0) | (locs >= num_pages * ps)
        if bad.any():
            raise InvariantViolation(
                "1-2-partition", f"{who} holds location {int(locs[bad.argmax()])}, not a page start of the pool"
            )
        claims.append((locs, who))

    claim(_array(cm.free_slots), "the free list")
    paths: Dict[int, Tuple[List[int], List[int]]] = {}
    for node in nodes:  # parents before children
        value, key = tolist(node.value), list(node.key)
        if len(value) != len(key) or len(key) % ps:
            raise InvariantViolation(
                "1-2-partition", f"cache node {node.id}: key length {len(key)}, {len(value)} locations, page size {ps}"
            )
        above = paths.get(node.parent.id, ([], [])) if node.parent is not None else ([], [])
        paths[node.id] = (above[0] + key, above[1] + value)
        claim(value[::ps], f"cache node {node.id}")
    locks: Dict[int, int] = {}
    for req in live:
        row, handle = rows[req.uid], req.cache_handle
        prefix = paths[handle.node.id][1] if handle.node is not None and handle.node.id in paths else []
        if handle.cached_len != len(prefix) or row[: len(prefix)] != prefix:
            raise InvariantViolation(
                "1-2-partition",
                f"uid {req.uid}: its row does not start with the {handle.cached_len} locations of the prefix it locked",
            )
        filled = _pages(req.cached_len, ps) * ps
        pages = np.asarray(row[:filled], dtype=np.int64).reshape(-1, ps)
        broken = (pages != pages[:, :1] + np.arange(ps)).reshape(-1)
        if broken.any():
            raise InvariantViolation(
                "1-2-partition", f"uid {req.uid}: its row is not page-contiguous at position {int(broken.argmax())}"
            )
        claim(row[len(prefix) : filled : ps], f"uid {req.uid}")
        node = handle.node
        while node is not None and node.parent is not None:
            locks[node.id] = locks.get(node.id, 0) + 1
            node = node.parent
    counts = np.bincount(np.concatenate([locs for locs, _ in claims]) // ps, minlength=num_pages)
    wrong = counts != 1
    if wrong.any():
        page = int(wrong.argmax())
        who = [w for locs, w in claims for _ in range(int((locs == page * ps).sum()))]
        raise InvariantViolation(
            "1-2-partition", f"page {page} (location {page * ps}) is owned by {who or 'nobody'}, not by exactly one"
        )
    for node in nodes:
        if node.ref_count != locks.get(node.id, 0):
            raise InvariantViolation(
                "1-2-partition",
                f"cache node {node.id} has lock count {node.ref_count}, "
                f"but {locks.get(node.id, 0)} live requests hold it",
            )
    return paths


def _check_request(sched: Any, req: Any) -> None:
    """The request's lengths against what was submitted, and its token-pool row."""
    prompt, max_tokens = sched.submitted[req.uid]
    ids = tolist(req.input_ids)
    where = f"uid {req.uid}"
    if ids[: len(prompt)] != list(prompt[: len(ids)]):
        raise InvariantViolation("8-request", f"{where}: its tokens do not start with its prompt")
    chunked = sched.is_chunked(req)
    # a chunk's request ends, for now, at its chunk: max_device_len is the chunk plus the output
    end = len(ids) + req.output_len if chunked else len(prompt) + max_tokens
    if req.max_device_len != end or req.output_len > max_tokens:
        raise InvariantViolation(
            "8-request",
            f"{where}: max_device_len {req.max_device_len} with output_len "
            f"{req.output_len}, but it was submitted with {len(prompt)} + "
            f"{max_tokens} tokens and holds {len(ids)}",
        )
    computed = len(ids) if chunked else len(ids) - 1  # a running request's last token has no KV yet
    if not 0 <= req.cache_handle.cached_len <= req.cached_len == computed or req.device_len != computed + 1:
        raise InvariantViolation(
            "8-request",
            f"{where}: lengths handle {req.cache_handle.cached_len}, cached "
            f"{req.cached_len}, device {req.device_len}, with {len(ids)} tokens "
            f"({'mid-chunk' if chunked else 'running'})",
        )
    if not chunked and len(ids) >= len(prompt) + max_tokens:
        raise InvariantViolation(
            "8-request", f"{where}: running with {len(ids) - len(prompt)} tokens generated of {max_tokens}"
        )
    admitted = req.max_device_len - req.output_len  # tokens it was admitted with
    if tolist(sched.tm.token_pool[req.table_idx][:admitted]) != ids[:admitted]:
        raise InvariantViolation(
            "8-request", f"{where}: its token-pool row does not hold its {admitted} admitted tokens"
        )


def _check_no_oom(sched: Any, live: List[Any], nodes: List[Any]) -> None:
    ps: int = sched.page_size
    pool = sched.num_pages * ps

    def worst(held: int, max_device_len: int) -> int:
        # KV is written for every position but the last sampled token's
        return max(_pages(max_device_len - 1, ps) - _pages(held, ps), 0) * ps

    if sched.policy.preempts:
        everyone = [(r.uid, r.max_device_len) for r in live] + [
            (p.uid, p.input_len + p.output_len) for p in sched.waiting
        ]
        for uid, length in everyone:
            if worst(0, length) > pool:
                raise InvariantViolation("3-no-oom", f"uid {uid} may need more than the pool's {pool} tokens")
        return
    available = len(sched.cm.free_slots) * ps + sum(len(n.key) for n in nodes if n.ref_count == 0)
    need = sum(worst(r.cached_len, r.max_device_len) for r in live)
    if need > available:
        raise InvariantViolation(
            "3-no-oom", f"live requests may still need {need} tokens of pages, only {available} available"
        )


def _check_provenance(
    provenance: KVProvenance,
    live: List[Any],
    nodes: List[Any],
    rows: Dict[int, List[int]],
    paths: Dict[int, Tuple[List[int], List[int]]],
) -> None:
    for req in live:  # first: a wrong reuse is named by the request that made it
        n = req.cached_len
        provenance.check(f"uid {req.uid}", rows[req.uid][:n], prefix_hashes(tolist(req.input_ids)[:n]))
    for node in nodes:
        tokens, locations = paths[node.id]
        start = len(tokens) - len(node.key)
        provenance.check(f"cache node {node.id}", locations[start:], prefix_hashes(tokens)[start:], start)


def check_queue_order(
    waiting: Sequence[int],
    arrival: Dict[int, int],
    admitted: Dict[int, int],
    preempted: Container[int],
    live: Container[int] = frozenset(),
    resume_order: str = "admission",
) -> None:
    """10-queue-order over a waiting queue (head first). `arrival` and `admitted` map uids to
    their submission and latest admission order numbers; `live` holds the queued uids that are
    admitted now (mid-prefill); `preempted` only names the others in a message.

    Always: requests never admitted wait in arrival order, behind every request admitted before.
    With `resume_order` "admission" (kvledger's own scheduler, vLLM's FCFS) also: requests mid-prefill
    wait ahead of those waiting again, and requests waiting again wait in the order they were
    first admitted, which under first come first served is their arrival order. Both schedulers
    keep the running requests (in admission order) followed by the waiting queue in arrival order:
    a victim is the last running request and goes to the queue's head (vLLM's
    `Scheduler.schedule` pops `running[-1]` and `_preempt_request` prepends it; kvledger's
    `CacheScheduler._requeue` inserts it behind the request mid-prefill). The latest admission
    is no order: a request resumed from the head, then preempted again while the one behind it
    still waits, goes back ahead of it. With "any" the order among requests admitted before is
    the subject's."""
    fresh = [u for u in waiting if u not in admitted]
    if fresh != sorted(fresh, key=lambda u: arrival[u]):
        raise InvariantViolation(
            "10-queue-order", f"requests never admitted wait in the order {fresh}, not in arrival order"
        )
    seen_fresh = None
    for uid in waiting:
        if uid not in admitted:
            seen_fresh = uid if seen_fresh is None else seen_fresh
        elif seen_fresh is not None:
            again = "preempted" if uid in preempted else "admitted before"
            raise InvariantViolation(
                "10-queue-order",
                f"uid {uid}, {again} and waiting again, waits behind uid {seen_fresh}, which was never admitted",
            )
    if resume_order == "any":
        return
    if resume_order != "admission":
        raise ValueError(f"resume_order is 'admission' or 'any', not {resume_order!r}")
    _check_resume_order(waiting, arrival, admitted, live)


def _check_resume_order(
    waiting: Sequence[int], arrival: Dict[int, int], admitted: Dict[int, int], live: Container[int]
) -> None:
    """The requests admitted before, at the queue's head: those mid-prefill first, then those
    waiting again in the order of their first admission (their arrival order)."""
    again = [(place, uid) for place, uid in enumerate(waiting) if uid in admitted and uid not in live]
    if again:
        first_place, first = again[0]
        late = next((p for p, u in enumerate(waiting) if u in live and p > first_place), None)
        if late is not None:
            raise InvariantViolation(
                "10-queue-order",
                f"uid {waiting[late]}, admitted and mid-prefill, waits at place {late} behind uid {first}, "
                f"which waits again at place {first_place} (places from 0 at the head)",
            )
    for (place, uid), (later_place, later) in zip(again, again[1:]):
        if arrival[later] < arrival[uid]:
            raise InvariantViolation(
                "10-queue-order",
                f"uid {uid} (arrival #{arrival[uid]}, latest admission #{admitted[uid]}) waits again at place "
                f"{place}, ahead of uid {later} (arrival #{arrival[later]}, latest admission #{admitted[later]}) "
                f"at place {later_place}, which was admitted first: requests waiting again resume in the "
                f"order of their first admission (places from 0 at the head)",
            )
