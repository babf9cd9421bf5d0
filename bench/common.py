"""What every benchmark shares: child processes (stub, Reef, LiteLLM), statistics, tables and results."""

from __future__ import annotations

import json
import os
import platform
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
LITELLM_VENV = ROOT / "bench" / ".venv-litellm"
PYTHON = sys.executable
MODEL = "fake-model"
#: Both proxies authenticate: Reef with this inference token, LiteLLM with it as master key (recent LiteLLM
#: refuses to start without one). The stub ignores it.
TOKEN = "sk-bench-" + secrets.token_hex(16)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Child:
    """A benchmark server in its own process (own GIL), stopped for good by :meth:`stop`."""

    def __init__(self, name: str, cmd: list[str], url: str, log_path: Path, env: dict | None = None,
                 health: str = "/healthz", unset: tuple[str, ...] = (), cwd: Path | None = None):
        self.name, self.cmd, self.url, self.health, self.cwd = name, cmd, url, health, cwd
        self.log_path = log_path
        self.env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in unset}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180, interval: float = 0.1) -> "Child":
        """Start the process and return once its health route answers 200 (polled every ``interval`` s)."""
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True, cwd=self.cwd)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + self.health, timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(interval)
        self.stop()
        raise RuntimeError(f"{self.name} did not become healthy in {timeout:g} s:\n{self.log_tail()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def peak_rss_mib(self) -> float | None:
        """Peak resident memory (VmHWM) of the process and its children, in MiB."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        return sum(_vm_hwm_kib(pid) for pid in _tree(self.pid)) / 1024

    def cpu_seconds(self, reaped: bool = False) -> float:
        """User + system CPU time used so far by the process and its children (all threads); ``reaped``: also what
        the children they waited for used (a short-lived subprocess that ended inside a window still counts)."""
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        return tree_cpu_seconds(self.pid, reaped)

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: workers spawned by it go too
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def wait_for_workers(child: "Child", count: int, timeout: float = 180) -> None:
    """Wait until ``count`` worker processes of a ``reef serve server.workers=N`` listen on its port."""
    import psutil

    port = int(child.url.rsplit(":", 1)[1])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listening = 0
        for pid in _tree(child.pid)[1:]:
            try:
                proc = psutil.Process(pid)
                if "reef_core.serve.process.worker" in " ".join(proc.cmdline()) and any(
                        c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in proc.net_connections("tcp")):
                    listening += 1
            except psutil.Error:
                continue
        if listening >= count:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{child.name}: {count} workers not listening within {timeout:g} s:\n{child.log_tail()}")


def _tree(pid: int) -> list[int]:
    pids, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        children = []  # each thread's own children: a process started from a thread is listed under it
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children += (task / "children").read_text().split()
            except OSError:
                continue
        for child in map(int, children):
            pids.append(child)
            frontier.append(child)
    return pids


def stat_cpu_seconds(stat: Path, reaped: bool = False) -> float:
    """utime + stime of a ``/proc/<pid>/stat`` or ``/proc/<pid>/task/<tid>/stat`` file (+ cutime + cstime with
    ``reaped``); 0 when it is gone."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15 if reaped else 13]) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int, reaped: bool = False) -> float:
    """:func:`stat_cpu_seconds` of ``pid`` and every process below it (each process's file covers all its threads)."""
    return sum(stat_cpu_seconds(Path(f"/proc/{p}/stat"), reaped) for p in _tree(pid))


def _vm_hwm_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def start_stub(workdir: Path) -> Child:
    """FakeUpstream in its own process (``python -m reef_core.testing.fake_upstream``)."""
    port = free_port()
    return Child("stub", [PYTHON, "-m", "reef_core.testing.fake_upstream", "--port", str(port)],
                 f"http://127.0.0.1:{port}", workdir / "stub.log").start()


def scoped_token(i: int) -> str:
    return f"{TOKEN}-scoped-{i}"


def scoped_tokens_override(count: int) -> str:
    """``server.scoped_tokens`` with ``count`` tokens, each confined to its own ``bench-<i>-*`` scenarios, with
    rate limits high enough never to refuse (so the limiter runs on every request); the last one also matches
    ``bench-latency``, the scenario the latency client uses."""
    entries = [f"{{name:bench-{i},token:{scoped_token(i)},scenarios:['bench-{i}-*'"
               + (",bench-latency" if i == count - 1 else "") + "],rpm:100000000,tpm:1000000000000}"
               for i in range(count)]
    return "server.scoped_tokens=[" + ",".join(entries) + "]"


def start_reef(stub_url: str, data_dir: Path, *overrides: str, name: str = "reef") -> Child:
    """``reef serve`` with the upstream engine and durable SQLite records (WAL, synchronous=FULL, the default)."""
    port = free_port()
    cmd = [PYTHON, "-m", "reef_core.cli", "serve", "engine.kind=upstream", f"engine.upstream_url={stub_url}",
           f"server.port={port}", f"storage.data_dir={data_dir}", "server.log_level=warning", *overrides]
    return Child(name, cmd, f"http://127.0.0.1:{port}", data_dir.parent / f"{name}.log", env={"REEF_TOKEN": TOKEN},
                 unset=("REEF_ADMIN_TOKEN", "REEF_UPSTREAM_API_KEY", "REEF_UPSTREAM_MODEL")).start()


def start_systems(workdir: Path, with_litellm: bool) -> tuple[list["Child"], dict[str, "Child"]]:
    """The compared systems: the stub, Reef in front of it, and LiteLLM in front of it (optional).

    Returns the started children (stop them in reverse order) and the targets by name."""
    children: list[Child] = []
    stub = start_stub(workdir)
    children.append(stub)
    reef = start_reef(stub.url, workdir / "data")
    children.append(reef)
    targets = {"stub": stub, "reef": reef}
    if with_litellm:
        litellm = start_litellm(stub.url, workdir)
        children.append(litellm)
        targets["litellm"] = litellm
    return children, targets


def litellm_available() -> bool:
    return (LITELLM_VENV / "bin" / "litellm").exists()


def start_litellm(stub_url: str, workdir: Path) -> Child:
    """The LiteLLM proxy with default settings and no database, routing ``fake-model`` to the stub."""
    if not litellm_available():
        raise RuntimeError("LiteLLM is not installed: run `bash bench/setup_litellm.sh` (or pass --no-litellm)")
    config = workdir / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: {stub_url}/v1\n"
        "      api_key: sk-dummy\n")
    port = free_port()
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_MASTER_KEY": TOKEN}
    cmd = [str(LITELLM_VENV / "bin" / "litellm"), "--config", str(config), "--host", "127.0.0.1",
           "--port", str(port)]
    return Child("litellm", cmd, f"http://127.0.0.1:{port}", workdir / "litellm.log", env=env,
                 health="/health/liveliness", unset=("DATABASE_URL",)).start(timeout=300)


def chat_body(text: str = "What is the capital of France? Answer in one word.") -> bytes:
    """The request every benchmark sends: a small two-message chat, like an agent's short turn."""
    return json.dumps({"model": MODEL, "max_tokens": 32, "messages": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": text}]}).encode()


def percentiles(samples: list[float]) -> dict:
    """p50/p95/p99/mean/max of ``samples`` (nearest-rank), rounded to microseconds of a millisecond."""
    if not samples:
        return {"n": 0}
    ordered = sorted(samples)
    n = len(ordered)

    def rank(p: float) -> float:
        return ordered[min(n - 1, max(0, int(round(p / 100 * n + 0.5)) - 1))]

    return {"n": n, "p50": round(rank(50), 3), "p95": round(rank(95), 3), "p99": round(rank(99), 3),
            "mean": round(sum(ordered) / n, 3), "max": round(ordered[-1], 3)}


def machine() -> dict:
    """What the numbers were measured on."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_kib = 0
    try:
        mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        pass
    load = os.getloadavg()
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem_kib / 2**20, 1),
            "python": platform.python_version(), "kernel": platform.release(),
            "load_avg_1m_at_start": round(load[0], 2), "wrk": shutil.which("wrk")}


def table(headers: list[str], rows: list[list]) -> str:
    """A plain text table, right-aligned numbers."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    for row in cells:
        out.append("  ".join(c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(row, widths)))
    return "\n".join(out)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _numeric(text: str) -> bool:
    return text.replace(",", "").replace(".", "").replace("-", "").replace("x", "").isdigit()


def write_result(name: str, result: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def chat_stream_events(response):
    """The JSON events of an OpenAI chat stream (``data:`` lines up to ``[DONE]``), as they arrive."""
    import json

    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def delta_text(event: dict) -> str:
    """The reply text one chat stream event carries."""
    return "".join((choice.get("delta") or {}).get("content") or "" for choice in event.get("choices") or [])
