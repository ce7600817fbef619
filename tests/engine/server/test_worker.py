"""The engine thread in-process (dummy weights, --verify): tokens flow to sinks, an abort frees the
request's pages before the next step, rejections name the field, overload answers 503, and a
fault inside a step fails every open request and takes the engine out of service."""

from __future__ import annotations

import queue
import time

import pytest

from kvledger.engine.server.detok import TextStream  # noqa: E402
from kvledger.engine.server.worker import Accepted, EngineWorker, Failed, Token  # noqa: E402
from kvledger.fast import SamplingParams  # noqa: E402

PAGES = 32


@pytest.fixture(scope="module")
def llm():
    from kvledger.engine.runtime.llm import LLM

    return LLM(dummy_weights=True, kv_cache_tokens=PAGES * 16, max_seq_len=128, verify=True)


@pytest.fixture
def worker(llm):
    w = EngineWorker(llm, max_waiting=4)
    w.start()
    yield w
    w.stop()


class Inbox:
    def __init__(self) -> None:
        self.q: "queue.Queue" = queue.Queue()

    def __call__(self, event) -> None:
        self.q.put(event)

    def get(self, timeout: float = 30.0):
        return self.q.get(timeout=timeout)

    def until_finished(self, timeout: float = 60.0) -> list:
        events = [self.get(timeout)]
        while not isinstance(events[-1], Failed) and not (isinstance(events[-1], Token) and events[-1].finished):
            events.append(self.get(timeout))
        return events


def wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_tokens_flow_and_the_engine_goes_idle_clean(worker):
    sinks = [Inbox() for _ in range(3)]
    for i, s in enumerate(sinks):
        worker.submit(list(range(10 + i, 40 + i)), greedy(5), s)
    for s in sinks:
        assert isinstance(s.get(), Accepted)
        toks = s.until_finished()
        assert len(toks) == 5 and all(isinstance(t, Token) for t in toks) and toks[-1].finish_reason == "length"
    wait_for(lambda: worker.integrity.checks >= 1 and worker.stats.running == 0)
    assert worker.integrity.ok and worker.integrity.leaked_pages == 0
    assert worker.stats.verified_ops and worker.stats.verified_ops > 0


def test_abort_frees_pages_before_the_next_step(worker):
    long, other = Inbox(), Inbox()
    uid = worker.submit(list(range(100, 160)), greedy(60), long)
    worker.submit(list(range(200, 230)), greedy(20), other)
    assert isinstance(long.get(), Accepted) and isinstance(long.get(), Token)
    wait_for(lambda: worker.stats.owned_pages > 0)
    worker.abort(uid)
    wait_for(lambda: worker.stats.aborted == 1)
    worker.abort(uid)  # a second abort of an ended request is a no-op
    assert isinstance(other.get(), Accepted)
    assert len(other.until_finished()) == 20  # the other request runs to its end
    wait_for(lambda: worker.stats.running == 0 and worker.integrity.checks >= 1)
    assert worker.integrity.ok and worker.stats.owned_pages == 0 and worker.stats.locked_tokens == 0
    assert worker.stats.failed == 0


def test_abort_while_waiting(worker):
    sinks = [Inbox() for _ in range(3)]
    uids = [worker.submit(list(range(300 + i, 340 + i)), greedy(8), s) for i, s in enumerate(sinks)]
    for u in uids:
        worker.abort(u)  # queued right behind its submit: it never runs
    for s in sinks:
        assert isinstance(s.get(), Accepted)
    wait_for(lambda: worker.stats.aborted == 3)
    wait_for(lambda: worker.integrity.checks >= 1)
    assert worker.integrity.ok and worker.stats.free_pages + worker.stats.cached_pages == PAGES


def test_rejections_name_the_field(worker):
    s = Inbox()
    worker.submit([10**6], greedy(4), s)
    failed = s.get()
    assert isinstance(failed, Failed) and failed.status == 400 and failed.param == "prompt"
    worker.submit(list(range(10, 20)), greedy(200), s)
    failed = s.get()
    assert isinstance(failed, Failed) and failed.param == "max_tokens" and "max_tokens" in failed.message
    worker.submit(list(range(10, 20)), SamplingParams(max_tokens=2, stop_token_ids=(10**6,)), s)
    failed = s.get()
    assert isinstance(failed, Failed) and failed.param == "stop_token_ids"
    assert worker.stats.rejected == 3 and worker.alive


def test_overload_answers_503(llm):
    w = EngineWorker(llm, max_waiting=2)  # not started: commands queue up, then apply in order
    sinks = [Inbox() for _ in range(4)]
    for s in sinks:
        w.submit(list(range(10, 30)), greedy(2), s)
    w.start()
    try:
        first = [s.get() for s in sinks]
        assert [type(e) for e in first] == [Accepted, Accepted, Failed, Failed]
        assert first[2].status == 503 and "overloaded" in first[2].message
        for s in sinks[:2]:
            s.until_finished()
    finally:
        w.stop()


def test_fault_in_a_step_fails_open_requests_and_stops_service(llm, monkeypatch):
    w = EngineWorker(llm)
    w.start()
    try:
        a, b = Inbox(), Inbox()
        w.submit(list(range(10, 30)), greedy(50), a)
        assert isinstance(a.get(), Accepted) and isinstance(a.get(), Token)

        def broken_step():
            raise RuntimeError("injected fault")

        monkeypatch.setattr(w.engine, "step", broken_step)
        events = a.until_finished()
        assert isinstance(events[-1], Failed) and events[-1].status == 500 and "injected fault" in events[-1].message
        assert not w.alive and "injected fault" in w.fatal
        w.submit(list(range(10, 30)), greedy(2), b)
        refused = b.get()
        assert isinstance(refused, Failed) and refused.status == 503
        assert w.stats.failed == 1
    finally:
        w.stop()
        monkeypatch.undo()
        for uid in list(w.engine.requests):  # leave the shared engine clean for other tests
            w.engine.abort(uid)


def test_text_stream_holds_partial_stop_strings_and_characters():
    vocab = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 6: "\xc3", 7: "\xa9"}

    def decode(ids):
        raw = "".join(vocab[i] for i in ids).encode("latin-1")
        return raw.decode("utf-8", errors="replace")

    ts = TextStream(decode, stop=["world"])
    out = []
    for t in (1, 2, 3, 4, 5):
        ts.add(t)
        out.append(ts.flush())
    assert "".join(out) == "Hello " and ts.stopped
    ts = TextStream(decode)
    ts.add(6)
    assert ts.flush() == ""  # half of "é"
    ts.add(7)
    assert ts.flush(final=True) == "é"


def test_fault_while_submitting_fails_that_request_too(llm, monkeypatch):
    w = EngineWorker(llm)
    w.start()
    try:

        def broken_submit(ids, params, uid=None):
            raise RuntimeError("injected submit fault")

        monkeypatch.setattr(w.engine, "add_request", broken_submit)
        s = Inbox()
        w.submit(list(range(10, 30)), greedy(2), s)
        failed = s.get()
        assert isinstance(failed, Failed) and failed.status == 500
        wait_for(lambda: w.fatal is not None)
        assert "injected submit fault" in w.fatal and w._thread.is_alive()
    finally:
        w.stop()
        monkeypatch.undo()


def test_a_request_whose_sampling_fails_fails_alone(llm, monkeypatch):
    """Non-finite logits for one request: that client gets a 500, the batch-mate finishes, the
    engine stays up and goes idle with every page accounted for."""
    w = EngineWorker(llm)
    forward = w.engine.runner.forward
    victim = {}

    def poisoned(batch, may_share):
        logits, tokens = forward(batch, may_share)
        logits = logits.clone()
        for row, i in enumerate(batch.sampled):
            if batch.requests[i].uid == victim.get("uid"):
                logits[row, 7] = float("nan")
        return logits, tokens

    monkeypatch.setattr(w.engine.runner, "forward", poisoned)
    w.start()
    try:
        checks = w.integrity.checks
        a, b = Inbox(), Inbox()
        sampled = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=3)
        victim["uid"] = w.submit(list(range(10, 30)), sampled, a)
        w.submit(list(range(40, 60)), sampled, b)
        failed = a.until_finished()[-1]
        assert isinstance(failed, Failed) and failed.status == 500 and "non-finite" in failed.message
        tokens = [e for e in b.until_finished() if isinstance(e, Token)]
        assert len(tokens) == 6 and tokens[-1].finish_reason == "length"
        assert w.alive and w.fatal is None
        wait_for(lambda: w.integrity.checks > checks)
        assert w.integrity.ok and w.integrity.leaked_pages == 0 and w.stats.failed == 1
    finally:
        w.stop()
        monkeypatch.undo()
