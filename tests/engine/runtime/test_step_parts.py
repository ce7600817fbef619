"""The step's collaborators on their own, without a model: the request records turn a step's
tokens into events and say what ended (the engine drops those), and Overlap's late stops change
only through its methods."""

from __future__ import annotations

from types import SimpleNamespace

from kvledger.engine.runtime.overlap import LaunchedStep, Overlap
from kvledger.engine.runtime.requests import Requests, TokenEvent
from kvledger.engine.runtime.scheduler import Batch
from kvledger.fast import SamplingParams

EOS = 9


def _step(uids, sampled=None) -> LaunchedStep:
    reqs = [SimpleNamespace(uid=u) for u in uids]
    rows = list(range(len(uids))) if sampled is None else sampled
    return LaunchedStep(Batch("decode", reqs, sampled=rows), None, None)


def _requests(*uids: int, temperature: float = 0.0) -> Requests:
    requests = Requests(frozenset({EOS}))
    for uid in uids:
        requests.add(uid, SamplingParams(temperature=temperature, max_tokens=8))
    return requests


def test_deliver_turns_tokens_into_events_and_reports_late_stops_and_ended_requests():
    requests = _requests(1, 2, 3, 4)
    requests.admitted(1, 5)
    step = _step([1, 2, 3, 4, 6])  # 6: aborted while the step was in flight
    finished = {2: "length", 4: "error"}
    delivered = requests.deliver(step.requests, step.sampled, [EOS, EOS, 3, 0, 1], finished, {4: "nan"})
    assert delivered.events == [
        TokenEvent(1, EOS, True, "stop", None, 5),  # a stop token its bookkeeping did not see: a late stop
        TokenEvent(2, EOS, True, "stop", None, 0),  # its last token is a stop token: "stop", not "length"
        TokenEvent(3, 3, False, None, None, 0),
        TokenEvent(4, 0, True, "error", "nan", 0),
    ]
    assert delivered.stopped_late == [1]
    assert delivered.ended == [1, 2, 4]
    assert 1 in requests and len(requests) == 4  # dropping them is the engine's (Engine._forget)


def test_stopped_finishing_and_cpu_sampling_read_the_records():
    requests = _requests(1, 2)
    assert not requests.sample_on_cpu(_step([1, 2]).requests, [0, 1])
    requests.add(3, SamplingParams(temperature=0.7, max_tokens=4))
    step = _step([1, 2, 3])
    assert requests.sample_on_cpu(step.requests, [0, 1, 2]) and not requests.sample_on_cpu(step.requests, [0, 1])
    assert requests.stopped(step.requests, step.sampled, [EOS, 4, 5], {3: "nan"}) == [1, 3]
    requests.finishing({1: "stop", 7: "length"})  # 7 is not live: nothing to mark
    assert requests[1].finishing == "stop" and requests[2].finishing is None
    requests.forget(3)
    assert not requests.sample_on_cpu(step.requests, [0, 1, 2])
    # a request dropped while its row is still in a batch samples greedily
    assert [p.is_greedy for p in requests.sampling_params([1, 3])] == [True, True]


def test_late_stops_are_taken_by_the_step_that_holds_them_or_popped_after_it():
    overlap = Overlap(True)
    overlap.stopped_late(5)
    overlap.stopped_late(7)
    assert overlap.take_late_stops(_step([7, 3, 8], sampled=[0, 1])) == [7]
    assert overlap.take_late_stops(_step([7])) == []  # taken once
    assert overlap.pop_late_stops() == [5] and overlap.pop_late_stops() == []
    assert overlap.late_stop_count == 2
    step = _step([1])
    overlap.hold(step)
    assert overlap.inflight is step and overlap.take_inflight() is step and overlap.inflight is None
