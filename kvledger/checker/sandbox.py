"""Checker work run where a subject's death cannot take the checker with it.

`call(isolation, fn, *args)` runs `fn(*args)` in a child process forked from this one and returns
what it returned (or raises what it raised); a `Server(isolation, handler)` answers many requests,
`server(*request)`, in one child, and forks a fresh one only after a death. A child opens a
write-ahead record first (`properties/write_ahead.py`), so every operation it applies is on disk
before it runs. If the child dies instead of answering (a signal such as SIGSEGV, an exit of its
own, the memory cap, or the hang watchdog's kill), the call raises `SubjectDied`: a `Finding` of kind

  subject-crashed:SIGSEGV   (or the signal's name) a signal ended it; SIGKILL not sent by kvledger
                            is most often the kernel's out-of-memory killer
  subject-crashed:exit-3    it exited (`os._exit(3)`) without answering
  subject-oom               it went past the memory cap (`Isolation.memory_cap_mb`, enforced as an
                            address-space limit: the allocation fails with MemoryError, which is
                            reported as this kind wherever it surfaces)
  subject-hung              it started no operation for `Isolation.hang_limit_s` (native code
                            that never returns to Python, where no alarm reaches it)

with the run's header and operations from the record (the last one in flight) and, as detail,
the Python stack at the death (`faulthandler` for a signal or the hang watchdog's SIGABRT, the
traceback for MemoryError).

Why fork, not spawn: the parent has imported the subject (vLLM takes seconds to import), so a
forked child starts in tens of milliseconds (the page tables of a 400 MB process), not seconds.
The parent only forks: it applies no operation itself while isolation is on, so no thread pool of
torch's is alive in it to be lost across the fork. A handler and `call`'s arguments are not pickled
(the child inherits them); a `Server`'s requests, the answers and the messages a child `send`s are.

With isolation off, both run here and `send` reaches `on_message` directly: one code path.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple, TypeVar

from kvledger.engine.ledger.finding import Finding
from kvledger.engine.ledger.ops import OpRecord
from kvledger.engine.ledger.trace import Header
from kvledger.properties import write_ahead
from kvledger.properties.isolation import Isolation

__all__ = ["Isolation", "Server", "SubjectDied", "call", "death", "send"]

log = logging.getLogger(__name__)
T = TypeVar("T")
OnMessage = Callable[[Any], None]
Handler = Callable[..., Any]

EXIT_OOM = 86  # the child's exit code when MemoryError reached its top (the cap was hit)
POLL_S = 0.5  # how often the parent looks at the child's record while it waits
ABORT_GRACE_S = 2.0  # how long a hung child has to write its stack before it is killed


class SubjectDied(Finding):
    """The child died: a Finding (kind, message, the Python stack at the death as detail, the
    step and operation in flight) with the run it was applying, `header` (None: no run had
    started) and `ops` (up to and including the one in flight)."""

    def __init__(self, kind: str, message: str, detail: str, header: Optional[Header], ops: List[OpRecord]) -> None:
        step = len(ops) if ops else None
        super().__init__(kind, message, detail, step, ops[-1].to_json() if ops else None)
        self.header, self.ops = header, ops

    def __reduce__(self) -> Any:  # a campaign task returns it across processes
        return (SubjectDied, (self.kind, self.message, self.detail, self.header, self.ops))


# -- in the child ------------------------------------------------------------------------------------
_sink: Optional[OnMessage] = None


def send(message: Any) -> None:
    """From inside a handler: hand `message` to the caller's `on_message` (dropped if none)."""
    if _sink is not None:
        _sink(message)


def _serve(requests: Connection, answers: Connection, files: Path, isolation: Isolation, handler: Handler) -> None:
    """The forked child: cap, record, answer requests until the parent closes the pipe, and leave
    without running the parent's exit handlers (pytest's, Ray's, atexit's)."""
    global _sink
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it kills us
    stack = open(files / "stack", "w")  # noqa: SIM115 (faulthandler writes to it at the death)
    # disabled first: enabling an enabled faulthandler only swaps its file, and a library that set
    # its own handler since (Ray's driver does) would keep the signal
    faulthandler.disable()
    faulthandler.enable(file=stack, all_threads=False)
    if isolation.memory_cap_mb:
        cap = _address_space() + isolation.memory_cap_mb * 2**20
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    write_ahead.open_log(files / "record.jsonl")
    _sink = lambda message: answers.send(("message", message))  # noqa: E731
    while True:
        try:
            request = requests.recv()
        except (EOFError, OSError):
            break
        try:
            answer: Any = ("returned", handler(*request))
        except MemoryError:
            stack.write(traceback.format_exc())
            stack.flush()
            os._exit(EXIT_OOM)
        except BaseException as e:  # noqa: BLE001 (handed to the parent, which raises it)
            answer = ("raised", e, traceback.format_exc())
        try:
            answers.send(answer)
        except Exception:  # an answer that does not pickle: its text goes instead
            answers.send(("raised", RuntimeError(f"{answer[0]} an unpicklable {type(answer[1]).__name__}"), ""))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


# -- in the parent -----------------------------------------------------------------------------------
class _Child:
    """One forked child serving `handler` (see `_serve`)."""

    def __init__(self, isolation: Isolation, handler: Handler) -> None:
        self.isolation = isolation
        self.files = Path(tempfile.mkdtemp(prefix="kvledger-sandbox-"))
        self.answers, answers = Pipe(duplex=False)
        requests, self.requests = Pipe(duplex=False)
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover (the child; it never returns)
            self.answers.close()
            self.requests.close()
            try:
                _serve(requests, answers, self.files, isolation, handler)
            finally:
                os._exit(70)
        answers.close()
        requests.close()
        self.alive = True

    def ask(self, request: Tuple[Any, ...], on_message: Optional[OnMessage]) -> Any:
        try:
            self.requests.send(request)
        except (BrokenPipeError, OSError):
            pass  # it died before it could read it: _wait sees the end
        answer, hung = self._wait(on_message)
        if answer is None:  # it died: reap it and say how
            self.alive = False
            code = self._reap()
            raise death(code, self.files / "record.jsonl", _read(self.files / "stack"), self.isolation, hung)
        if answer[0] == "returned":
            return answer[1]
        error = answer[1]
        if answer[2]:
            error.add_note(f"raised in the sandbox's child:\n{answer[2]}")
        raise error

    def _wait(self, on_message: Optional[OnMessage]) -> tuple[Any, bool]:
        """Read the child's messages until its answer or its end; kill it when it stops making
        progress (no message and no new operation recorded for the hang limit)."""
        record = self.files / "record.jsonl"
        last_seen: Any = _stat(record)
        progress_at = time.monotonic()
        while True:
            try:
                ready = self.answers.poll(POLL_S)
                message = self.answers.recv() if ready else None
            except (EOFError, OSError):  # it died (or exited) without answering
                return None, False
            if message is not None:
                if message[0] != "message":
                    return message, False
                progress_at = time.monotonic()
                if on_message is not None:
                    on_message(message[1])
                continue
            seen, now = _stat(record), time.monotonic()
            if seen != last_seen:
                last_seen, progress_at = seen, now
            elif now - progress_at > self.isolation.hang_limit_s:
                # SIGABRT first: faulthandler writes the stack it hangs in (the finding's detail)
                os.kill(self.pid, signal.SIGABRT)
                with contextlib.suppress(EOFError, OSError):
                    self.answers.poll(ABORT_GRACE_S)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                return None, True

    def _reap(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        return os.waitstatus_to_exitcode(status)

    def close(self) -> None:
        """Let an idle child leave (its pipe closes), or kill one still working; reap it."""
        self.requests.close()
        self.answers.close()
        if self.alive:
            self.alive = False
            deadline = time.monotonic() + ABORT_GRACE_S
            while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    os.kill(self.pid, signal.SIGKILL)
                    os.waitpid(self.pid, 0)
                    break
                time.sleep(0.001)
        shutil.rmtree(self.files, ignore_errors=True)


class Server:
    """`handler(*request)` answered in a child under `isolation` (here, when it is off), the same
    child for every request until one kills it; the next request forks a fresh one. Use it as a
    context manager, or `close` it."""

    def __init__(self, isolation: Isolation, handler: Handler) -> None:
        self.isolation, self.handler = isolation, handler
        self._child: Optional[_Child] = None
        self.forks = 0  # children started: 1 plus one per death

    def __call__(self, *request: Any, on_message: Optional[OnMessage] = None) -> Any:
        global _sink
        if not self.isolation.enabled:
            previous, _sink = _sink, on_message
            try:
                return self.handler(*request)
            finally:
                _sink = previous
        if self._child is None or not self._child.alive:
            if self._child is not None:
                self._child.close()
            self._child = _Child(self.isolation, self.handler)
            self.forks += 1
        try:
            return self._child.ask(request, on_message)
        except (KeyboardInterrupt, SystemExit):  # the parent is stopping: its child goes too
            self.close()
            raise

    def close(self) -> None:
        if self._child is not None:
            self._child.close()
            self._child = None

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def call(isolation: Isolation, fn: Callable[..., T], *args: Any, on_message: Optional[OnMessage] = None) -> T:
    """`fn(*args)` in a child of its own (see the module docstring); `SubjectDied` if it dies."""
    with Server(isolation, lambda: fn(*args)) as server:
        value: T = server(on_message=on_message)
        return value


def _stat(path: Path) -> Any:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns)


def death(code: int, record: Path, stack: str, isolation: Isolation, hung: bool = False) -> SubjectDied:
    """The finding a process's death is (see the module docstring): `code` its exit code as
    `multiprocessing` gives it (negative: the signal), `record` its write-ahead record, `stack` the
    Python stack it left, `hung` whether the hang watchdog killed it."""
    sequence = write_ahead.last_sequence(record)
    header, ops = sequence if sequence is not None else (None, [])
    if hung:
        kind, how = "subject-hung", f"was killed after starting no operation for {isolation.hang_limit_s:g} s"
    elif code == EXIT_OOM:
        kind, how = "subject-oom", f"ran out of memory (its cap: {isolation.memory_cap_mb} MB beyond what it inherited)"
    elif code < 0:
        name = _signal_name(-code)
        kind, how = f"subject-crashed:{name}", f"was killed by {name}"
        if -code == signal.SIGKILL:
            how += " (not by kvledger: most often the kernel's out-of-memory killer)"
    else:
        kind, how = f"subject-crashed:exit-{code}", f"exited with code {code} without answering"
    if ops:
        where = f"at operation {len(ops)} ({ops[-1].name})"
    elif header is not None:
        where = "while its subject was being built"
    else:
        where = "before applying any operation"
    stack = stack.split("\n\nExtension modules:")[0].strip()  # faulthandler's list of loaded extensions: noise
    return SubjectDied(kind, f"the checked process {how} {where}", stack, header, ops)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal-{number}"
