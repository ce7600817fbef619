"""Subjects that die worse than by raising: the toy block cache (`toy_block_subject.py`) with one
deadly line in `computed`, reached only once two requests hold pages and one of them has computed
two pages, so a fuzzer needs a few operations to get there and a minimizer has something to cut.

  segv      dereferences NULL through ctypes: the process dies with SIGSEGV
  exit      `os._exit(3)`: the process ends with exit code 3, no exception, no message
  oom       allocates 64 MB blocks it keeps until an allocation fails (the sandbox's memory cap)
  hang      blocks SIGALRM (as native code that never returns to Python is out of its reach) and
            spins forever

Each is a `module:factory` spec for the CLI: `tests.support.dying_subject:segv`, ...
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from typing import List

from kvledger.properties.subject import SubjectConfig
from tests.support.toy_block_subject import ToyBlockCache


class DyingCache(ToyBlockCache):
    name = "dying"

    def __init__(self, config: SubjectConfig, death: str) -> None:
        super().__init__(config)
        self.death = death
        self.hoard: List[bytearray] = []

    def computed(self, uid: int, start: int, end: int, token: int | None) -> None:
        if len(self.tables) >= 2 and end >= 2 * self.bs:
            self.die()
        super().computed(uid, start, end, token)

    def die(self) -> None:
        if self.death == "segv":
            ctypes.string_at(0)
        elif self.death == "exit":
            os._exit(3)
        elif self.death == "oom":
            while True:
                self.hoard.append(bytearray(64 << 20))
        elif self.death == "hang":
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            while True:
                time.sleep(0.05)


def segv(config: SubjectConfig) -> DyingCache:
    return DyingCache(config, "segv")


def exits(config: SubjectConfig) -> DyingCache:
    return DyingCache(config, "exit")


def oom(config: SubjectConfig) -> DyingCache:
    return DyingCache(config, "oom")


def hang(config: SubjectConfig) -> DyingCache:
    return DyingCache(config, "hang")
