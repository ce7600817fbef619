"""`python tests/support/fault_injecting_server.py ARGS`: `kvledger serve` with one fault planted:
every engine step after a request whose prompt starts with FAULT_PROMPT is submitted raises, as a
genuine engine fault would. Importing this module changes nothing; running it patches the engine."""

from __future__ import annotations

import sys

FAULT_PROMPT = [4242, 4242, 4242]


def plant_fault() -> None:
    from kvledger.engine.runtime.engine import Engine

    add_request, step = Engine.add_request, Engine.step
    armed = []

    def submit_watching(self, token_ids, params, uid=None):
        uid = add_request(self, token_ids, params, uid)
        if list(token_ids[:3]) == FAULT_PROMPT:
            armed.append(uid)
        return uid

    def step_failing(self):
        if armed:
            raise RuntimeError("injected engine fault")
        return step(self)

    Engine.add_request, Engine.step = submit_watching, step_failing


if __name__ == "__main__":
    from kvledger.cli import main

    plant_fault()
    sys.exit(main(["serve", *sys.argv[1:]]))
