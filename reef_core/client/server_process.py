"""A ``reef serve`` child process on a free loopback port: for demos, benchmarks and tests that drive a real server.

    server = ReefProcess(data_dir, ["+recipe=sao", "+sao_profile=tiny"]).start()
    ...  # talk to server.url
    server.stop()
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

#: The command that runs ``reef``: this interpreter's CLI module, so the child uses the same installation.
REEF = [sys.executable, "-m", "reef_core.cli"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ReefProcess:
    """``reef serve`` with the given overrides, as a child process; restartable on the same data."""

    def __init__(self, data_dir: Path, overrides: list[str], env: dict | None = None):
        self.data_dir = data_dir
        self.port = free_port()
        self.overrides = [f"storage.data_dir={data_dir}", f"server.port={self.port}", *overrides]
        self.env = {**os.environ, **(env or {})}
        #: The command that runs ``reef`` (a wheel-installed console script in packaging tests).
        self.command = list(REEF)
        self.proc: subprocess.Popen | None = None
        self.log_path = data_dir.parent / f"reef-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> "ReefProcess":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([*self.command, "serve", *self.overrides], stdout=log, stderr=subprocess.STDOUT,
                                     env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"reef serve exited {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"reef serve did not become healthy:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:] if self.log_path.exists() else ""

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def restart(self) -> "ReefProcess":
        self.stop()
        return self.start()
