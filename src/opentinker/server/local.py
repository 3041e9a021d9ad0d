"""Run a server in a child process on a free loopback port (for tests and benchmarks).

    with LocalServer(["--dev", "--base-model", "opentinker/tiny"], data_dir=d) as srv:
        client = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-…")

``kill()`` is a ``kill -9`` (no clean shutdown), for crash tests; ``start()`` again restarts on
the same data dir and the same port, so clients made before the crash reach the new process.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import IO, Self


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalServer:
    def __init__(self, args: list[str], *, data_dir: str | Path, startup_timeout: float = 180.0) -> None:
        self.args = args
        self.data_dir = Path(data_dir)
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self._log: IO[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "server.log"

    def start(self) -> Self:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        self._log = self.log_path.open("ab")
        cmd = [sys.executable, "-m", "opentinker.server", *self.args]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--data-dir", str(self.data_dir)]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ})
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {self.log_path}")
            if self.healthy():
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the server did not answer /healthz within {self.startup_timeout} s")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/api/v1/healthz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        """``kill -9``: no shutdown handlers run."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._close_log()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()
