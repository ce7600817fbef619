"""What the engine knows of a request: the limits a request is checked against when it arrives,
its record while it lives (`Requests` holds the live ones), and the event that delivers each of
its tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, Iterator, List, Optional, Sequence, Set

from kvledger import fast
from kvledger.engine.runtime.request_error import RequestError
from kvledger.engine.runtime.sampling import validate_sampling
from kvledger.reference.pages import tokens_to_finish

_GREEDY = fast.SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class RequestLimits:
    """What one engine can ever run; the server reads them to answer before submitting."""

    max_seq_len: int
    vocab_size: int
    page_size: int
    pool_tokens: int

    def validate(self, token_ids: Sequence[int], params: fast.SamplingParams) -> None:
        """Raise RequestError naming the field if the request can never run."""
        n, vocab = len(token_ids), self.vocab_size
        if n == 0:
            raise RequestError("prompt", "prompt is empty")
        # min/max first: a per-token Python check costs ~0.3 ms for a 2k-token prompt
        bad = (
            [] if 0 <= min(token_ids) and max(token_ids) < vocab else [t for t in token_ids if not 0 <= int(t) < vocab]
        )
        if bad:
            raise RequestError("prompt", f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        validate_sampling(params)
        bad = [t for t in params.stop_token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise RequestError("stop_token_ids", f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        limit = self.max_seq_len
        if n >= limit:
            raise RequestError(
                "prompt", f"prompt is {n} tokens, longer than max_seq_len allows ({limit - 1} + 1 generated)"
            )
        if n + params.max_tokens > limit:
            raise RequestError(
                "max_tokens", f"max_tokens {params.max_tokens} plus the {n}-token prompt exceeds max_seq_len {limit}"
            )
        need = tokens_to_finish(0, n + params.max_tokens, self.page_size)
        if need > self.pool_tokens:
            raise RequestError(
                "max_tokens",
                f"max_tokens {params.max_tokens}: the request may need {need} "
                f"KV tokens, the pool holds {self.pool_tokens}",
            )


@dataclass
class RequestRecord:
    """The engine's state of one request, from submit until it ends; dropped then. (Its pages and
    page-table row are the cache scheduler's; its sampling generator is the sampler's.)"""

    uid: int
    params: fast.SamplingParams
    stop_ids: FrozenSet[int] = frozenset()  # tokens that end it: its stop_token_ids, and EOS unless ignore_eos
    cached_tokens: Optional[int] = None  # prompt tokens found in the prefix cache, set at admission
    finishing: Optional[str] = None  # its finish reason once bookkeeping released it, before delivery

    @classmethod
    def of(cls, uid: int, params: fast.SamplingParams, eos_token_ids: FrozenSet[int]) -> RequestRecord:
        stops = frozenset(params.stop_token_ids)
        return cls(uid, params, stops if params.ignore_eos else stops | eos_token_ids)


@dataclass
class TokenEvent:
    uid: int
    token: int
    finished: bool
    finish_reason: Optional[str]  # "length", "stop" (EOS or a stop token), "error", or None
    error: Optional[str] = None  # why the request failed (finish_reason "error"); its token is not output
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission


@dataclass
class Delivery:
    """One step's delivered tokens, and what the engine does about them."""

    events: List[TokenEvent]
    stopped_late: List[int]  # greedy requests whose token stops them, unseen by the bookkeeping (overlap)
    ended: List[int]  # requests whose last token this is: the engine drops them


class Requests:
    """The live requests' records, from submit until their last token is delivered, and which of
    them sample on the CPU (every other one is greedy, its token already on the device)."""

    def __init__(self, eos_token_ids: FrozenSet[int]) -> None:
        self.eos_token_ids = eos_token_ids
        self._records: Dict[int, RequestRecord] = {}
        self._cpu_sampled: Set[int] = set()

    def add(self, uid: int, params: fast.SamplingParams) -> None:
        self._records[uid] = RequestRecord.of(uid, params, self.eos_token_ids)
        if not params.is_greedy:
            self._cpu_sampled.add(uid)

    def forget(self, uid: int) -> None:
        self._records.pop(uid, None)
        self._cpu_sampled.discard(uid)

    def get(self, uid: int) -> Optional[RequestRecord]:
        return self._records.get(uid)

    def __getitem__(self, uid: int) -> RequestRecord:
        return self._records[uid]

    def __contains__(self, uid: object) -> bool:
        return uid in self._records

    def __iter__(self) -> Iterator[int]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def admitted(self, uid: int, cached_len: int) -> None:
        rec = self._records[uid]
        if rec.cached_tokens is None:  # the first chunk's cached length is the prefix hit
            rec.cached_tokens = cached_len

    # -- one step's rows (`reqs[i]` for i in `sampled`: the rows that sampled a token) ------------
    def sample_on_cpu(self, reqs: Sequence[Any], sampled: Sequence[int]) -> bool:
        """Whether a row samples on the CPU, so the step's bookkeeping must see its tokens. (A
        greedy request that may stop on a token is handled by a late stop instead.)"""
        cpu = self._cpu_sampled
        if not cpu:  # all greedy, as in the throughput benchmarks: no per-row look
            return False
        return any(reqs[i].uid in cpu for i in sampled)

    def sampling_params(self, uids: Sequence[int]) -> List[fast.SamplingParams]:
        # a request that stopped late is still in its batch; its token is dropped: take the greedy one
        return [rec.params if (rec := self._records.get(u)) is not None else _GREEDY for u in uids]

    def stopped(
        self, reqs: Sequence[Any], sampled: Sequence[int], values: Sequence[int], failed: Dict[int, str]
    ) -> List[int]:
        """The uids, in batch order, whose token stops them or whose sampling failed."""
        stop = []
        for i, t in zip(sampled, values):
            rec = self._records.get(reqs[i].uid)
            if rec is not None and (rec.uid in failed or t in rec.stop_ids):
                stop.append(rec.uid)
        return stop

    def finishing(self, finished: Dict[int, Optional[str]]) -> None:
        """The step's bookkeeping released these requests; their tokens are not delivered yet."""
        records = self._records
        for uid, reason in finished.items():
            rec = records.get(uid)
            if rec is not None:  # None: it stopped late, and was delivered as finished already
                rec.finishing = reason

    def deliver(
        self,
        reqs: Sequence[Any],
        sampled: Sequence[int],
        values: Sequence[int],
        finished: Dict[int, Optional[str]],
        failed: Dict[int, str],
    ) -> Delivery:
        """The step's tokens as events, one per live row; which of them stopped late (a stop
        token the bookkeeping did not see) and which requests ended."""
        events: List[TokenEvent] = []
        stopped_late: List[int] = []
        ended: List[int] = []
        get_record, get_reason, get_error, event = self._records.get, finished.get, failed.get, TokenEvent
        for i, t in zip(sampled, values):
            uid = reqs[i].uid
            rec = get_record(uid)
            if rec is None:  # aborted, or stopped late, while this step was in flight
                continue
            reason = get_reason(uid)
            rec.finishing = None
            if t in rec.stop_ids:
                if reason is None:  # its step's bookkeeping ran before the value was known
                    stopped_late.append(uid)
                    reason = "stop"
                elif reason == "length":  # its last token is a stop token, as without overlap
                    reason = "stop"
            events.append(event(uid, t, reason is not None, reason, get_error(uid), rec.cached_tokens or 0))
            if reason is not None:
                ended.append(uid)
        return Delivery(events, stopped_late, ended)
