"""The workload a target is fuzzed with: the lockstep walk reads the reference, the subject walk
reads the driver's View of the subject (`fuzz_case.Workload` is the seam they share).

The walks are imported when a target needs one: a Hypothesis run in the same process (the zoo's
CI-profile sequences) draws from the literals of the modules loaded, so loading only what the
target uses keeps its derandomized sequences the same as a plain `kvledger check`.
"""

from __future__ import annotations

from typing import Any, Optional

from kvledger.checker.fuzz_case import Workload
from kvledger.properties.target import LockstepTarget, SubjectTarget


def workload_for(target: Any, admission: Optional[str] = None) -> Workload:
    """The workload a target is fuzzed with; `admission` forces the policy of lockstep cases."""
    if isinstance(target, LockstepTarget):
        from kvledger.checker.lockstep_walk import LockstepWorkload

        return LockstepWorkload(target, admission)
    if isinstance(target, SubjectTarget):
        from kvledger.checker.subject_walk import SubjectWorkload

        return SubjectWorkload(target)
    raise TypeError(f"no workload for {type(target).__name__}")
