"""`python tests/support/fault_injecting_server.py ARGS`: `kvledger serve` with one fault planted:
every engine step after a request whose prompt starts with FAULT_PROMPT is submitted raises, as a
genuine engine fault would. Importing this module changes nothing; running it patches the engine."""

from __future__ import annotations

import sys

FAULT_PROMPT = [4242, 4242, 4242]


def plant_fault() -> None:
    from kvledger.engine.runtime.scheduler import Scheduler

    submit, step = Scheduler.submit, Scheduler.step
    armed = []

    def submit_watching(self, uid, token_ids, params):
        if list(token_ids[:3]) == FAULT_PROMPT:
            armed.append(uid)
        return submit(self, uid, token_ids, params)

    def step_failing(self):
        if armed:
            raise RuntimeError("injected engine fault")
        return step(self)

    Scheduler.submit, Scheduler.step = submit_watching, step_failing


if __name__ == "__main__":
    from kvledger.engine.server.serve import main

    plant_fault()
    sys.exit(main(sys.argv[1:]))
