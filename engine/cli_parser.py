"""The argument parser of every kvledger command: a bad argument is one line on stderr naming it
(argparse's default prints the whole usage first, which buries the error), and exit status 2."""

from __future__ import annotations

import argparse
from typing import NoReturn


class OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")
