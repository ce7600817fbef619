"""How a target's runs are isolated from the checker: the settings `kvledger/checker/sandbox.py`
runs them under. A target carries its `Isolation`; the commands read it, never a global.

A subject is someone else's code, and some of it is native (SGLang's Rust tree core, CUDA and
ctypes calls): a segfault, an `os._exit` or a runaway allocation there would end the checker's own
process and lose the finding. Isolated, the subject runs in a child process with a memory cap and
a write-ahead record of its operations, and its death is a finding with the trace that caused it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEATH_KINDS", "DEFAULT_MEMORY_CAP_MB", "HANG_LIMIT_S", "IN_PROCESS", "ISOLATED", "Isolation", "is_death"]

# What a child may allocate beyond the address space it inherits. A cache manager on kvledger's
# pools (at most a few thousand pages) needs megabytes: a gigabytes-sized cap only stops a runaway.
DEFAULT_MEMORY_CAP_MB = 4096
# A child that starts no operation for this long is killed as hung. Subject calls are bounded in
# process (`subject_calls.CALL_LIMIT_S`) where a signal reaches them; this is the backstop for native
# code that never returns to Python.
HANG_LIMIT_S = 90.0


@dataclass(frozen=True)
class Isolation:
    """`enabled`: run in a child process (else in this one, as kvledger's own pure-Python managers
    can); `memory_cap_mb`: what the child may allocate beyond what it inherits (0: no cap);
    `hang_limit_s`: how long a child may go without starting an operation."""

    enabled: bool = True
    memory_cap_mb: int = DEFAULT_MEMORY_CAP_MB
    hang_limit_s: float = HANG_LIMIT_S

    def __post_init__(self) -> None:
        if self.memory_cap_mb < 0:
            raise ValueError(f"memory cap must be >= 0 MB (0: no cap), got {self.memory_cap_mb}")
        if self.hang_limit_s <= 0:
            raise ValueError(f"hang limit must be > 0 s, got {self.hang_limit_s}")

    @staticmethod
    def off() -> Isolation:
        return IN_PROCESS


ISOLATED = Isolation()  # the default of a subject
IN_PROCESS = Isolation(enabled=False)  # the default of lockstep

# The kinds of finding a process's death is (`kvledger/checker/sandbox.py`): a trace of one of them
# is only ever replayed in a child, whatever its target's isolation says, or it would kill the replayer.
DEATH_KINDS = ("subject-crashed:", "subject-oom", "subject-hung")


def is_death(kind: str) -> bool:
    return kind.startswith(DEATH_KINDS)
