"""The protocol of a subject that schedules itself: its own waiting queue, budget, preemption,
speculation and KV loads, driven one step at a time (vLLM's real `Scheduler`).

`properties/subject.py` drives a cache manager call by call, with kvledger playing the scheduler.
A subject whose capabilities say `schedules` is driven one level up instead: kvledger submits
requests, asks for a step, plays the model (and the drafter, and the outside KV store) for what
the step scheduled, and hands the outputs back; the subject's own scheduler decides who runs,
who is preempted, in which order requests wait, and how far ahead KV is allocated. The judge
then checks the same View as for any subject, plus what the step says it did (the `Plan`): so a
finding is a sequence the real scheduler produced, not one an adapter assumed.

The calls, as a step sees them:

  submit(uid, prompt, max_tokens)   the request exists; the subject queues it
  schedule(budget) -> Plan          one scheduling step with a token budget (None: the subject's
                                    configured one); the Plan says what runs, what was preempted
  output(outputs, loaded)           the model's outputs for the oldest step still in flight, by
                                    uid (`Output`), and the uids whose outside KV finished loading;
                                    the subject appends tokens, rolls back rejected drafts, ends
                                    requests (max_tokens, or `Output.stop`), files KV in its cache
  finish(uid)                       a running request ended outside a step (a stop string)
  abort(uid)                        dropped, waiting or running (or loading KV)
  view() -> View                    as for every subject (`properties/subject.py`)
  cache_key(tokens, group)          the key its prefix cache files `tokens` under, per KV group

A subject with `in_flight` 2 (vLLM's async scheduling) is asked for step N+1 before step N's
outputs arrive; the driver keeps the outputs of each step as the model "ran" it and delivers the
oldest once `in_flight` steps are scheduled.

Speculation (`spec_tokens` K > 0): after each output the driver proposes up to K draft tokens per
running request (`Output.drafts`); the next step schedules the request's last token plus the
drafts (`Scheduled.drafts`); the model writes KV for all of them, accepts the first m drafts and
samples one more token (`Output.tokens` = the m accepted drafts + that token). KV written at the
rejected positions holds other tokens: the judge reads it as such.

Outside KV (`external_kv`): the subject's connector asks the driver's `ExternalStore` how many
tokens past its local hit the store holds; KV loaded from there counts as written when the load
completes (`Plan.loading`, then `output(..., loaded)`), never before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

from kvledger.properties.subject import Capabilities, View


@dataclass(frozen=True)
class Scheduled:
    """One request in a step's batch. Positions [start, end) of its tokens (prompt + output, as
    the subject knows them) get KV in this step; `drafts` are verified at [end, end + len(drafts))."""

    uid: int
    start: int  # its computed KV before the step (after a hit: the hit)
    end: int
    drafts: Tuple[int, ...] = ()
    hit: Optional[int] = None  # admitted (or resumed) in this step: tokens it found cached, outside KV included
    external: int = 0  # of the hit, tokens loaded from outside (`ExternalStore`)


@dataclass(frozen=True)
class Plan:
    """What one step did, in the subject's order."""

    scheduled: Tuple[Scheduled, ...] = ()
    preempted: Tuple[int, ...] = ()  # the uids the step preempted, in order
    # admitted in this step, holding pages, waiting for outside KV: each is also in `scheduled`,
    # with start == end == its local hit, its `hit` and `external` (nothing is computed for it yet)
    loading: Tuple[int, ...] = ()
    refused: Optional[int] = None  # the waiting head it could not admit (the walk of its queue ended there)


@dataclass(frozen=True)
class Output:
    """The model's output for one scheduled request: `tokens` sampled (accepted drafts, then the
    bonus token; empty for a prefill chunk that is not the prompt's last), `stop` if the last
    one is a stop token, and the drafts proposed for its next step."""

    tokens: Tuple[int, ...] = ()
    stop: bool = False
    drafts: Tuple[int, ...] = ()


class ExternalStore(Protocol):
    """The KV outside the subject's pool (a connector's store), played by the driver."""

    def match(self, tokens: Sequence[int], local_hit: int) -> Tuple[int, bool]:
        """(tokens past `local_hit` whose KV the store holds for this prefix, whether the load is
        asynchronous)."""
        ...


@runtime_checkable
class SchedulingSubject(Protocol):
    name: str
    version: str
    capabilities: Capabilities

    def submit(self, uid: int, prompt: Sequence[int], max_tokens: int) -> None: ...
    def schedule(self, budget: Optional[int]) -> Plan: ...
    def output(self, outputs: Dict[int, Output], loaded: Sequence[int] = ()) -> None: ...
    def finish(self, uid: int) -> None: ...
    def abort(self, uid: int) -> None: ...
    def view(self) -> View: ...
    def cache_key(self, tokens: Sequence[int], group: int = 0) -> Hashable: ...


@dataclass
class Step:
    """A scheduled step the model has run, whose outputs the subject has not been handed yet."""

    plan: Plan
    outputs: Dict[int, Output] = field(default_factory=dict)
    loaded: List[int] = field(default_factory=list)
    ending: List[int] = field(default_factory=list)  # the requests whose last token this step sampled
