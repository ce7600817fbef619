"""Which judge-mode driver drives a subject: the call-level `SubjectDriver` (kvledger plays the
scheduler), or the `SchedulingDriver` for a subject whose own scheduler decides each step
(capability `schedules`).

The scheduling driver's module is imported only for such a subject: Hypothesis draws some
integers from the literals of every local module loaded, so loading it for every subject would
change the sequences a seeded run of the others draws.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Union

from kvledger.properties.subject import SubjectConfig
from kvledger.properties.subject_driver import SubjectDriver

if TYPE_CHECKING:
    from kvledger.properties.scheduling_driver import SchedulingDriver

Driver = Union[SubjectDriver, "SchedulingDriver"]


def driver_for(
    subject: Any, config: SubjectConfig, *, check: bool = True, on_event: Callable[[str], None] | None = None
) -> Driver:
    """The driver for `subject` on the pool `config`."""
    if getattr(subject.capabilities, "schedules", False):
        from kvledger.properties.scheduling_driver import SchedulingDriver

        return SchedulingDriver(subject, config, check=check, on_event=on_event)
    return SubjectDriver(subject, config, check=check, on_event=on_event)
