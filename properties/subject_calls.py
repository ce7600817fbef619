"""Calling a subject: an exception out of its code, or a call that never returns, is a finding.

A subject is someone else's code: whatever it raises is a `subject-raised:X` finding with its
traceback, never a traceback of the checker's; a call still running after `CALL_LIMIT_S` is
`subject-hung`.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import traceback
from typing import Any, Callable, Iterator

from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import InvalidOp

# A call into the subject takes microseconds; one still running after this long never returns (a
# zoo edit of a radix walk that loops, growing memory, was seen). The limit is a safety net, not a
# decision: no sound run comes within four orders of magnitude of it.
CALL_LIMIT_S = 30.0


class _Hung(BaseException):
    pass


@contextlib.contextmanager
def _watchdog(seconds: float) -> Iterator[None]:
    """Raise _Hung in this thread after `seconds` (the main thread only, where signals arrive)."""
    if threading.current_thread() is not threading.main_thread() or signal.getitimer(signal.ITIMER_REAL)[0]:
        yield
        return

    def hung(signum: int, frame: Any) -> None:
        raise _Hung()

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def call_subject(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, the subject's `what`; a Finding for what it raises or a call that hangs."""
    try:
        with _watchdog(CALL_LIMIT_S):
            return fn(*args)
    except (Finding, InvalidOp):
        raise
    except _Hung:
        raise Finding(
            "subject-hung",
            f"{what}{args!r:.120} did not return within {CALL_LIMIT_S:.0f} s (a loop that never ends)",
            traceback.format_exc(),
        ) from None
    except Exception as e:  # the subject failed inside its own code: a finding, not our crash
        raise Finding(f"subject-raised:{type(e).__name__}", f"{what}{args!r:.120}: {e}", traceback.format_exc()) from e
