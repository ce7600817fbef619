"""uvicorn's Server with a drain: the first SIGTERM or SIGINT stops new requests and gives open ones
the drain window to finish (`EngineWorker.drain`) before the server exits; a second signal ends the
window at once (what is still open ends with an explicit error event, then the server exits); a
third is uvicorn's own (exit now)."""

from __future__ import annotations

import logging
import threading
from types import FrameType
from typing import Optional

import uvicorn

from kvledger.engine.server.worker import EngineWorker

log = logging.getLogger("kvledger.serve")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, worker: EngineWorker, drain_seconds: float) -> None:
        super().__init__(config)
        self.worker = worker
        self.drain_seconds = drain_seconds
        self._signals = 0

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        self._signals += 1
        if self._signals == 1 and not self.should_exit:
            log.warning("signal %d: draining open requests (up to %g s), then exiting", sig, self.drain_seconds)
            self.worker.drain(self.drain_seconds)
            threading.Thread(target=self._exit_when_drained, name="kvledger-drain", daemon=True).start()
        elif self._signals == 2 and not self.should_exit:
            log.warning("signal %d again: stopping open requests now", sig)
            self.worker.drain(0.0)
        else:
            super().handle_exit(sig, frame)

    def _exit_when_drained(self) -> None:
        self.worker.drained.wait()
        self.should_exit = True
