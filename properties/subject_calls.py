"""Calling a subject: an exception out of its code, or a call that never returns, is a finding.

A subject is someone else's code: whatever it raises is a `subject-raised:X` finding with its
traceback, never a traceback of the checker's (`subject-oom` for a failed allocation); a call
still running after `CALL_LIMIT_S` is `subject-hung`.
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
    except (Exception, SystemExit) as e:  # the subject failed inside its own code: a finding, not our crash
        raise raised(e, f"{what}{args!r:.120}") from e


def raised(e: BaseException, where: str) -> Finding:
    """The finding for what a subject raised `where`: `subject-oom` for a failed allocation (the
    sandbox's memory cap is enforced that way), else `subject-raised:<type>`. An exception with no
    message (a bare `assert`) is named by the line that raised it."""
    kind = "subject-oom" if is_out_of_memory(e) else f"subject-raised:{type(e).__name__}"
    return Finding(kind, f"{where}: {describe(e)}", traceback.format_exc())


def describe(e: BaseException) -> str:
    """`e`'s message, or for one without (an AssertionError of a bare `assert`) its type and the
    file and line that raised it."""
    text = str(e)
    if text and text != "None":
        return text
    frames = traceback.extract_tb(e.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
    return f"{type(e).__name__}{where}"


def is_out_of_memory(e: BaseException) -> bool:
    """An allocation that failed: Python's MemoryError, or torch's and numpy's own errors for it."""
    if isinstance(e, MemoryError):
        return True
    text = str(e)
    return type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in text or "Unable to allocate" in text
