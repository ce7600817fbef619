"""The judge-mode driver (properties/subject_driver.py) around the subject-independent judge: one bug
planted in a small block cache (tests/support/toy_block_subject.py), and the finding, its kind, and
that the fuzzer and minimizer turn it into a short trace. The judge's clauses one by one are
tests/properties/test_subject_judge.py's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvledger.properties.subject import SubjectConfig
from kvledger.properties.subject_driver import SubjectDriver
from kvledger.properties.target import SubjectTarget, header_of, replay
from tests.support.paths import SUPPORT
from tests.support.toy_block_subject import ToyBlockCache

CONFIG = SubjectConfig(num_pages=8, page_size=2, max_seq_len=16, max_running_req=4)


def replay_on(factory, config, ops):
    """(the first finding or None, the run) of `ops` on a fresh subject built for `config`."""
    return replay(SubjectTarget(factory, "toy"), header_of(config, None, "test", "toy", ""), ops)


def run(bug, ops):
    return replay_on(lambda config: ToyBlockCache(config, bug), CONFIG, ops)[0]


SHARED = [
    {"op": "submit", "uid": 0, "tokens": [1, 2, 3, 4, 5], "max_tokens": 2},
    {"op": "prefill", "budget": 64, "sample": [7]},
    {"op": "submit", "uid": 1, "tokens": [1, 2, 3, 4, 6], "max_tokens": 2},
    {"op": "prefill", "budget": 64, "sample": [7]},
    {"op": "decode", "sample": [7]},
]


def test_the_sound_toy_keeps_every_invariant():
    assert (
        run(
            None,
            SHARED + [{"op": "submit", "uid": 2, "tokens": [1, 2], "max_tokens": 1}, {"op": "prefill", "budget": 64}],
        )
        is None
    )


@pytest.mark.parametrize(
    "bug, kind",
    [
        ("leak-on-release", "1-2-partition"),
        ("hit-skips-ref", "1-2-partition"),
        ("key-forgets-parent", "7-kv-provenance"),
    ],
)
def test_a_planted_bug_is_a_finding_of_its_kind(bug, kind):
    finding = run(bug, SHARED)
    assert finding is not None and finding.kind == kind, finding


def test_a_hit_covering_the_last_prompt_token_is_named():
    ops = [
        {"op": "submit", "uid": 0, "tokens": [1, 2, 3, 4], "max_tokens": 1},
        {"op": "prefill", "budget": 64},
        {"op": "submit", "uid": 1, "tokens": [1, 2, 3, 4], "max_tokens": 1},
        {"op": "prefill", "budget": 64},
    ]
    assert run(None, ops) is None
    finding = run("hit-covers-last-token", ops)
    assert finding.kind == "8-request" and "leave the last prompt token" in finding.message


def test_an_exception_inside_the_subject_is_a_finding_with_its_traceback():
    ops = SHARED[:1] + [{"op": "abort", "uid": 0}]
    finding = run("abort-raises", ops)
    assert finding.kind == "subject-raised:KeyError"
    assert "toy_block_subject.py" in finding.detail and "in abort" in finding.detail


def test_worst_case_promise_broken_is_3_no_oom():
    class Overbooks(ToyBlockCache):
        def __init__(self, config):
            super().__init__(config)
            self.capabilities = replace(self.capabilities, worst_case_admission=True, preempts=False)

    ops = [{"op": "submit", "uid": u, "tokens": [u, u, u, u, u], "max_tokens": 8} for u in range(3)]
    ops += [{"op": "prefill", "budget": 64}] + [{"op": "decode"}] * 8
    finding, _ = replay_on(Overbooks, SubjectConfig(num_pages=12, page_size=2, max_seq_len=16), ops)
    assert finding.kind == "3-no-oom"


def test_a_preempted_request_waits_again_at_the_head_and_finishes():
    config = SubjectConfig(num_pages=4, page_size=2, max_seq_len=8)
    driver = SubjectDriver(ToyBlockCache(config), config)
    driver.apply({"op": "submit", "uid": 0, "tokens": [1, 2, 3], "max_tokens": 4})
    driver.apply({"op": "submit", "uid": 1, "tokens": [4, 5, 6], "max_tokens": 4})
    driver.apply({"op": "prefill", "budget": 64})
    driver.apply({"op": "decode"})  # position 3: in the requests' second blocks
    assert driver.running == [0, 1]
    driver.apply({"op": "decode"})  # position 4 needs a block: the newest request gives its up
    assert driver.waiting == [1] and driver.running == [0] and 1 in driver.preempted
    for _ in range(8):
        driver.apply({"op": "decode"} if driver.running else {"op": "prefill", "budget": 64})
    assert not driver.waiting and not driver.running


def test_fuzz_and_minimize_a_users_subject(tmp_path, monkeypatch, capsys):
    from kvledger.cli import main

    monkeypatch.syspath_prepend(str(SUPPORT))  # the subject is named by module: toy_block_subject:leaky
    code = main(
        [
            "fuzz",
            "--subject",
            "toy_block_subject:leaky",
            "--seconds",
            "60",
            "--max-cases",
            "5",
            "--out-dir",
            str(tmp_path),
            "--minimize-replays",
            "200",
        ]
    )
    out = capsys.readouterr().out
    assert code == 1 and "FOUND 1-2-partition at step" in out and "a leak" in out
    small = sorted(tmp_path.glob("*.min.jsonl"))
    assert small
    from kvledger.engine.ledger import trace

    header, ops = trace.read(small[0])
    assert header.subject == "toy_block_subject:leaky" and len(ops) <= 4
    assert main(["replay", str(small[0])]) == 1
    assert main(["replay", str(small[0]), "--subject", "toy_block_subject:factory"]) == 0
