"""Workloads that reach the hard states of any cache manager, for the fuzzer and the state machine.

Prompts are a few *stems* (token strings shared across requests) cut at lengths biased to page
boundaries and one token either side, plus a short random tail, over a tiny alphabet; a quarter
of submissions repeat an earlier prompt exactly. That is what reaches, on every subject:
prefixes that diverge inside a cached page and after a cached entry's first page, re-hits of
pages nobody holds (a block cache's free pool, a radix tree's unlocked leaves), hits on a request
still mid-prefill (small budgets leave it chunked), and a full pool with locked entries (small
pools). Everything is drawn from one `random.Random`, so a seed gives the same case anywhere.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import OpResult
from kvledger.properties.subject import SubjectConfig

ALPHABET = 4


@dataclass(frozen=True)
class Shape:
    config: SubjectConfig
    stems: tuple[tuple[int, ...], ...]


def draw_shape(rng: random.Random, page_sizes: Sequence[int] = (1, 2, 4)) -> Shape:
    ps = rng.choice(page_sizes)
    num_pages = rng.randint(max(6, 24 // ps), max(12, 64 // ps))
    max_seq_len = min(num_pages * ps, 48)
    stems = tuple(tuple(rng.randrange(ALPHABET) for _ in range(4 * ps + 2)) for _ in range(rng.randint(1, 3)))
    return Shape(
        SubjectConfig(num_pages=num_pages, page_size=ps, max_seq_len=max_seq_len, max_running_req=rng.randint(3, 8)),
        stems,
    )


def draw_prompt(rng: random.Random, shape: Shape, history: Sequence[Sequence[int]], room: int) -> List[int]:
    """A prompt of at most `room` tokens (room >= 1)."""
    if history and rng.random() < 0.25:
        old = list(rng.choice(history))
        if len(old) <= room:
            return old
    ps = shape.config.page_size
    stem = rng.choice(shape.stems)
    cut = rng.choice([ps - 1, ps, ps + 1, 2 * ps - 1, 2 * ps, 2 * ps + 1, 3 * ps, rng.randint(0, len(stem))])
    tail = [rng.randrange(ALPHABET) for _ in range(rng.randint(0, 2 * ps + 1))]
    prompt = (list(stem[: max(cut, 0)]) + tail)[:room]
    return prompt or [rng.randrange(ALPHABET)]


def next_op(
    rng: random.Random, shape: Shape, driver: Any, next_uid: int, history: List[List[int]]
) -> Dict[str, Any] | None:
    """One operation for the driver's current state (None: nothing sensible to do)."""
    cfg, ps = shape.config, shape.config.page_size
    waiting, running = driver.waiting, driver.running
    choices = [
        ("submit", 30 if len(waiting) < 6 else 3),
        ("prefill", 30 if waiting else 0),
        ("decode", 25 if running else 0),
        ("finish", 4 if running else 0),
        ("abort", 4 if waiting or running else 0),
        ("evict", 4 if driver.caps.explicit_evict else 0),
    ]
    kind = rng.choices([c for c, _ in choices], [w for _, w in choices])[0]
    if kind == "submit":
        max_tokens = rng.choice([1, 1, 2, 3, 5, 8])
        room = min(cfg.max_seq_len, cfg.num_pages * ps + 1) - max_tokens
        if room < 1:
            return None
        prompt = draw_prompt(rng, shape, history, room)
        history.append(prompt)
        return {"op": "submit", "uid": next_uid, "tokens": prompt, "max_tokens": max_tokens}
    sample = [rng.randrange(ALPHABET) for _ in range(2)]
    if kind == "prefill":
        budget = rng.choice([1, ps, ps + 1, 2 * ps, 3 * ps + 1, 64])
        return {"op": "prefill", "budget": budget, "sample": sample}
    if kind == "decode":
        stop = [u for u in running if rng.random() < 0.1]
        op: Dict[str, Any] = {"op": "decode", "sample": sample, "stop": stop}
        drafts = driver.caps.spec_tokens
        if drafts:  # a subject that speculates: how many of each request's drafts the model accepts
            op["accept"] = [rng.randint(0, drafts) for _ in range(2)]
            op["sample"] = sample + [rng.randrange(ALPHABET) for _ in range(drafts)]
        return op
    if kind == "finish":
        return {"op": "finish", "uid": rng.choice(running)}
    if kind == "abort":
        return {"op": "abort", "uid": rng.choice(list(waiting) + list(running))}
    return {"op": "evict", "tokens": rng.choice([1, ps, 4 * ps])}


def drain_op(driver: Any, stalled: int) -> Dict[str, Any] | None:
    """The next operation that moves every request towards its end: a prefill while one can admit,
    else a decode; None when all ended, or when nothing runs and the waiting head never fits
    (`stalled`: the prefills in a row that ran nothing)."""
    if driver.running and (stalled or not driver.waiting):
        return {"op": "decode", "sample": [1]}
    if driver.waiting and stalled <= 2:
        return {"op": "prefill", "budget": 64, "sample": [1]}
    return None


DRAIN_LIMIT = 400  # operations of a drain at most


def stalled_after(stalled: int, op: Dict[str, Any], out: OpResult) -> int:
    """The prefills in a row that ran nothing, after `op` ran with result `out`."""
    return stalled + 1 if op["op"] == "prefill" and not out.batch else 0


def drain_steps(
    driver: Any,
    apply: Callable[[Dict[str, Any]], Optional[OpResult]],
    limit: int = DRAIN_LIMIT,
    stalled: int = 0,
) -> Iterator[None]:
    """Drive every request towards its end with `drain_op`, each operation through `apply` (None:
    the driver refused it as invalid), at most `limit` operations, `stalled` prefills in a row
    having run nothing before it; one iteration per operation the driver ran. For a subject that
    preempts (optimistic admission: a step that finds no room gives up its newest request instead
    of failing), it is a `liveness` Finding if requests still run after it (preemption going round
    in circles), or if nothing runs and the waiting head is a request the subject preempted: it
    fit the pool once, and an idle pool holds more (for a subject with an admission margin, only if
    it once fit with no prefix hit). A head never admitted at all is judged only
    for a subject that schedules itself (vLLM's Scheduler keeps no margin: the driver took the
    request because the pool holds all of it, every KV group at once); a call-level subject may
    keep a margin of its pool (SGLang's token ratio), so a request sized to the whole pool can
    wait on an idle subject."""
    if driver.caps.schedules:
        # judged on the drain's own prefills: the walk's last ones may have had budgets too small
        # for what the subject's scheduler must schedule at once (a request resumed ready to
        # decode takes its token and its spec pads together in vLLM)
        stalled = 0
    for _ in range(limit):
        op = drain_op(driver, stalled)
        if op is None:
            break
        out = apply(op)
        if out is not None:
            stalled = stalled_after(stalled, op, out)
            yield
    head = driver.waiting[0] if driver.waiting else None
    stuck = driver.running or head in driver.preempted
    if head in driver.preempted and driver.caps.admission_margin and head not in driver.fit_alone:
        # admitted only on a prefix hit whose pages others held: with the subject's margin its
        # whole need may exceed an idle pool, so an idle subject that leaves it waiting is not stuck
        stuck = bool(driver.running)
    if driver.caps.schedules and driver.waiting and not driver.running:
        stuck = True  # an idle pool that every waiting request fits, and nothing admitted
    if driver.caps.preempts and stuck:
        raise Finding(
            "liveness",
            f"once submissions stopped, waiting {list(driver.waiting)} and running {list(driver.running)} "
            f"never ended (a drain of at most {limit} operations: prefill while admission runs a batch, "
            f"else decode)",
        )


def drain(
    driver: Any,
    apply: Callable[[Dict[str, Any]], Optional[OpResult]],
    limit: int = DRAIN_LIMIT,
    stalled: int = 0,
) -> None:
    """`drain_steps` run to its end (the state machine's drain rule)."""
    for _ in drain_steps(driver, apply, limit, stalled):
        pass
