"""Start `python -m kvledger serve` as a child process on a free loopback port and wait for /health
(for tests and scripts)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, List, Optional, Sequence

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`with ServerProcess(["--verify"]) as srv: srv.url ...`; the log is kept in a temp file."""

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        startup_timeout: float = 180.0,
        entry: Sequence[str] = ("-m", "kvledger", "serve"),
    ) -> None:
        """entry: what follows the interpreter (a test may run a script that wraps the server)."""
        self.entry = list(entry)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args: List[str] = ["--host", "127.0.0.1", "--port", str(self.port), *args]
        self.startup_timeout = startup_timeout
        self.proc: Optional[subprocess.Popen] = None
        self._log: Optional[IO[bytes]] = None

    def start(self) -> "ServerProcess":
        self._log = tempfile.NamedTemporaryFile(prefix="kvledger-serve-", suffix=".log", delete=False)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
        }
        self.proc = subprocess.Popen(
            [sys.executable, *self.entry, *self.args], cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"server not healthy after {self.startup_timeout} s:\n{self.log()}")

    def log(self, tail: Optional[int] = 5000) -> str:
        """The server's output so far: its last `tail` characters, or all of it with `tail=None`."""
        if self._log is None:
            return ""
        self._log.flush()
        text = Path(self._log.name).read_text(errors="replace")
        return text if tail is None else text[-tail:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self._log is not None:
            self._log.close()
            Path(self._log.name).unlink(missing_ok=True)
            self._log = None

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
