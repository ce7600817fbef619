"""The Hypothesis state machine in judge mode: one subject alone, judged after every operation.

`machine_for(factory)` builds a `RuleBasedStateMachine` over a subject factory. Each example draws
a pool (page size 1, 2 or 4; a small pool, so eviction and refusals happen) and prompt stems, then
runs submit / prefill / decode / finish / abort / evict rules through the `SubjectDriver`; a
finding fails the example, Hypothesis shrinks it, and the last (shrunk) failing sequence is kept
as a trace (`last_failure`). Prompts are stems cut near page boundaries plus short tails, and
exact repeats of earlier prompts, as the fuzzer draws them (`subject_workload.py`), so the same
rare events are reached: `REACHED` / `FIRST_REACHED` record, per event, the number of the example
that first reached it (counts, never time).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import InvalidOp, OpResult
from kvledger.properties.subject import Subject, SubjectConfig
from kvledger.properties.subject_driver import SubjectDriver
from kvledger.properties.subject_workload import ALPHABET, drain_op

SUBJECT_EXAMPLES = {"ci": 300, "deep": 3000, "dev": 30}  # examples per profile in judge mode
SUBJECT_STEPS = {"ci": 40, "deep": 80, "dev": 30}


class Progress:
    """What one run of the machine reached (reset per run)."""

    def __init__(self) -> None:
        self.sequences = 0
        self.reached: Dict[str, int] = {}  # event -> the first sequence that reached it
        self.last_failure: tuple[SubjectConfig, List[Dict[str, Any]], Finding] | None = None


def machine_for(
    factory: Callable[[SubjectConfig], Subject], progress: Progress, page_sizes: Sequence[int] = (1, 2, 4)
) -> type:
    tokens = st.integers(0, ALPHABET - 1)

    class SubjectMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            progress.sequences += 1
            self.driver: SubjectDriver | None = None
            self.ops: List[Dict[str, Any]] = []
            self.history: List[List[int]] = []
            self.next_uid = 0
            self.failed = False

        @initialize(ps=st.sampled_from(list(page_sizes)), pages=st.integers(4, 16), data=st.data())
        def build(self, ps: int, pages: int, data: st.DataObject) -> None:
            stems = data.draw(
                st.lists(st.lists(tokens, min_size=4 * ps + 2, max_size=4 * ps + 2), min_size=1, max_size=3),
                label="stems",
            )
            self.stems = stems
            self.config = SubjectConfig(
                num_pages=pages,
                page_size=ps,
                max_seq_len=min(pages * ps, 48),
                max_running=data.draw(st.integers(2, 6), label="max_running"),
            )
            seen = progress.sequences

            def note(name: str) -> None:
                event(name)
                progress.reached.setdefault(name, seen)

            self.driver = SubjectDriver(factory(self.config), self.config, on_event=note)

        def _apply(self, op: Dict[str, Any]) -> OpResult:
            try:
                out = self.driver.apply(op)
            except InvalidOp:
                return OpResult()
            except Finding as f:
                self.ops.append(op)
                self.failed = True
                progress.last_failure = (self.config, list(self.ops), f)
                raise
            self.ops.append(op)
            return out

        @rule(data=st.data(), max_tokens=st.sampled_from([1, 2, 3, 5, 8]))
        def submit(self, data: st.DataObject, max_tokens: int) -> None:
            ps = self.config.page_size
            room = self.config.max_seq_len - max_tokens
            if room < 1:
                return
            if self.history and data.draw(st.booleans(), label="repeat"):
                prompt = data.draw(st.sampled_from(self.history), label="earlier prompt")[:room]
            else:
                stem = data.draw(st.sampled_from(self.stems), label="stem")
                cut = data.draw(
                    st.sampled_from([ps - 1, ps, ps + 1, 2 * ps - 1, 2 * ps, 2 * ps + 1, 3 * ps, len(stem)]),
                    label="cut",
                )
                tail = data.draw(st.lists(tokens, max_size=2 * ps + 1), label="tail")
                prompt = (stem[:cut] + tail)[:room] or [0]
            self.history.append(prompt)
            self._apply({"op": "submit", "uid": self.next_uid, "tokens": prompt, "max_tokens": max_tokens})
            self.next_uid += 1

        @precondition(lambda self: self.driver is not None and bool(self.driver.waiting))
        @rule(budget=st.sampled_from([1, 2, 3, 5, 9, 64]), sample=st.lists(tokens, min_size=1, max_size=2))
        def prefill(self, budget: int, sample: List[int]) -> None:
            self._apply({"op": "prefill", "budget": budget, "sample": sample})

        @precondition(lambda self: self.driver is not None and bool(self.driver.running))
        @rule(sample=st.lists(tokens, min_size=1, max_size=2), data=st.data())
        def decode(self, sample: List[int], data: st.DataObject) -> None:
            stop = data.draw(st.lists(st.sampled_from(self.driver.running), unique=True, max_size=1), label="stop")
            self._apply({"op": "decode", "sample": sample, "stop": stop})

        @precondition(lambda self: self.driver is not None and bool(self.driver.running))
        @rule(data=st.data())
        def finish(self, data: st.DataObject) -> None:
            self._apply({"op": "finish", "uid": data.draw(st.sampled_from(self.driver.running), label="uid")})

        @precondition(lambda self: self.driver is not None and bool(self.driver.waiting or self.driver.running))
        @rule(data=st.data())
        def abort(self, data: st.DataObject) -> None:
            uid = data.draw(st.sampled_from(self.driver.waiting + self.driver.running), label="uid")
            self._apply({"op": "abort", "uid": uid})

        @precondition(lambda self: self.driver is not None and self.driver.caps.explicit_evict)
        @rule(tokens=st.sampled_from([1, 2, 4, 16]))
        def evict(self, tokens: int) -> None:
            self._apply({"op": "evict", "tokens": tokens})

        def teardown(self) -> None:
            """Drain: every request runs to its end, then quiescence is judged (by the driver)."""
            if self.driver is None or self.failed:
                return
            stalled = 0
            for _ in range(400):
                op = drain_op(self.driver, stalled)
                if op is None:
                    break
                out = self._apply(op)
                stalled = stalled + 1 if op["op"] == "prefill" and not out.batch else 0

    SubjectMachine.__name__ = "SubjectMachine"
    return SubjectMachine
