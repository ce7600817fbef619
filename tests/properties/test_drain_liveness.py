"""The drain's liveness rule for a preempted request left waiting on an idle subject
(`subject_workload.drain`): a finding unless the subject keeps an admission margin and admitted
the request only on a prefix hit."""

from types import SimpleNamespace
from typing import Any, Dict, Optional

import pytest

from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import OpResult
from kvledger.properties.subject import Capabilities
from kvledger.properties.subject_workload import drain


def _idle_driver(*, margin: bool, fit_alone: bool) -> Any:
    """Nothing runs; uid 7, preempted, heads the queue and the subject never admits it again."""
    caps = Capabilities(
        page_size=4,
        pages=(1, 2, 3),
        worst_case_admission=False,
        preempts=True,
        explicit_evict=True,
        cached_pages_in_free_pool=False,
        admission_margin=margin,
    )
    return SimpleNamespace(caps=caps, running=[], waiting=[7], preempted={7}, fit_alone={7} if fit_alone else set())


def _refuse(op: Dict[str, Any]) -> Optional[OpResult]:
    return OpResult(batch=())


@pytest.mark.parametrize("margin", [False, True])
def test_a_preempted_request_that_once_fit_alone_and_never_resumes_is_a_liveness_finding(margin: bool) -> None:
    with pytest.raises(Finding) as caught:
        drain(_idle_driver(margin=margin, fit_alone=True), _refuse)
    assert caught.value.kind == "liveness"


def test_without_a_margin_the_rule_holds_whatever_the_admission_hit() -> None:
    with pytest.raises(Finding):
        drain(_idle_driver(margin=False, fit_alone=False), _refuse)


def test_a_margin_subject_may_leave_a_request_it_admitted_only_on_a_hit() -> None:
    drain(_idle_driver(margin=True, fit_alone=False), _refuse)  # no finding


def test_a_margin_subject_that_keeps_requests_running_is_still_judged() -> None:
    driver = _idle_driver(margin=True, fit_alone=False)
    driver.running = [3]

    def decode_nothing(op: Dict[str, Any]) -> Optional[OpResult]:
        return OpResult(batch=())

    with pytest.raises(Finding):
        drain(driver, decode_nothing, limit=5)
