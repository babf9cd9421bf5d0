"""Pytest fixtures shared by Reef's test suites (core and recipe packages).

Loaded by the repository's root ``conftest.py`` (``pytest_plugins``); recipe packages outside this
repository may load it the same way. Everything here is real: processes, sockets,
SQLite/PostgreSQL, git. The upstream provider is FakeUpstream, a protocol-faithful fake.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from reef_core.client.server_process import REEF, ReefProcess, free_port  # noqa: F401 - the suite's names


@pytest.fixture(scope="session", autouse=True)
def _shared_model_cache(tmp_path_factory):
    # Servers started by tests share built/converted models (SmolLM2 takes a minute to convert).
    os.environ.setdefault("REEF_MODEL_CACHE", str(tmp_path_factory.getbasetemp() / "models"))
    # A process that drops REEF_* (a fresh venv's server) caches in this user's cache: never the real ~/.cache. The
    # compiled kernels stay where they were before XDG_CACHE_HOME was set, so a test session does not rebuild them.
    # (reef_core.engines.kernels.cache_dir, without importing torch here).
    xdg = os.environ.get("XDG_CACHE_HOME")
    user_cache = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    os.environ.setdefault("REEF_KERNEL_CACHE", str(user_cache / "reef" / "kernels"))
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.getbasetemp() / "xdg-cache")
    yield


@pytest.fixture(scope="session")
def fake_tool_model_dir(_shared_model_cache):
    """The fake tool-calling model (:mod:`reef_core.testing.fake_tool_model`), built once per session."""
    from reef_core.testing.fake_tool_model import ensure_fake_tool_model

    return ensure_fake_tool_model(Path(os.environ["REEF_MODEL_CACHE"]) / "fake-tool-model")


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch):
    # A developer's own tokens or upstream must never leak into a test.
    for var in ("REEF_TOKEN", "REEF_ADMIN_TOKEN", "REEF_UPSTREAM_URL", "REEF_UPSTREAM_API_KEY",
                "REEF_LOAD_PLUGINS", "REEF_DISABLE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    yield


# ---------------------------------------------------------------------------------------------
# A real `reef serve` process on a free loopback port.
# ---------------------------------------------------------------------------------------------

import signal
import socket
import subprocess
import time
import uuid

import httpx


def wait_until(predicate, timeout: float = 300.0, interval: float = 0.1, what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy (and return that); fail after ``timeout`` s.

    The one polling helper of the test suite: a test waits for what it cannot be notified of with a
    deadline, never with a bare sleep."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:g} s")
        time.sleep(interval)


def learner_idle(base_url: str, scenario: str) -> bool:
    """Whether ``scenario``'s learner has nothing running or scheduled, seen twice 0.2 s apart (a report wakes it
    as it arrives, so one look right after a report could precede the wake-up)."""
    url = f"{base_url}/reef/scenarios/{scenario}/status"
    for look in range(2):
        if httpx.get(url, timeout=30).json()["learner"] != "idle":
            return False
        if look == 0:
            time.sleep(0.2)
    return True


def learn_in_rounds(run, base_url: str, scenario: str, rounds: int = 10, per_round: int = 48,
                    timeout: float = 300.0) -> list[float]:
    """Rewards of ``rounds`` x ``per_round`` rollouts of ``run(base_url, scenario, n, seed=round, quiet=True)`` (an
    example client's ``run``), waiting after each round until the learner has trained what it got.

    A client that never waits sees as many training steps as the learner manages while it runs, which depends on
    how fast steps are next to replies (another engine, a slower or faster machine); waiting makes a learning test
    measure learning per rollout."""
    rewards: list[float] = []
    for round_ in range(rounds):
        rewards += run(base_url, scenario, per_round, seed=round_, quiet=True)["rewards"]
        wait_until(lambda: learner_idle(base_url, scenario), timeout=timeout, what=f"{scenario}'s learner idle")
    return rewards


def _server_factory(base: Path):
    started: list[ReefProcess] = []

    def start(*overrides: str, env: dict | None = None, data_dir: Path | None = None,
              timeout: float = 120) -> ReefProcess:
        proc = ReefProcess(data_dir or base / f"data-{len(started)}", list(overrides), env)
        started.append(proc)
        return proc.start(timeout)

    return start, started


@pytest.fixture
def reef_server(tmp_path):
    """Factory: ``reef_server(*overrides, env=None)`` starts a server; all are stopped at teardown."""
    start, started = _server_factory(tmp_path)
    yield start
    for proc in started:
        proc.stop()


@pytest.fixture(scope="module")
def module_reef_server(tmp_path_factory):
    """Like ``reef_server`` but shared by a module's tests (they must use distinct scenarios)."""
    start, started = _server_factory(tmp_path_factory.mktemp("reef"))
    yield start
    for proc in started:
        proc.stop()


@pytest.fixture(scope="session")
def fake_upstream_url():
    """A protocol-faithful fake OpenAI/Anthropic upstream in its own process."""
    from reef_core.testing.fake_upstream import serve_fake_upstream

    with serve_fake_upstream(mode="process") as url:
        yield url


@pytest.fixture
def upstream(fake_upstream_url):
    """Controls of the session's fake provider, reset (no faults, zeroed counters) around each test."""
    from reef_core.testing.fake_upstream import FakeUpstreamControl

    with FakeUpstreamControl(fake_upstream_url) as control:
        control.reset()
        yield control
        control.clear()


def sse_events(response: httpx.Response) -> list[tuple[str | None, object]]:
    """The SSE events of a streamed response as ``(event name, parsed JSON data)``; ``[DONE]`` stays a string."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data = line[len("data: "):]
            events.append((name, data if data == "[DONE]" else json.loads(data)))
            name = None
    return events


def _postgres_available() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5432), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_overrides(request):
    """Record-store overrides: SQLite in the data dir, or a fresh schema in the PostgreSQL test database."""
    if request.param == "sqlite":
        return []
    if not _postgres_available():
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL is not reachable at 127.0.0.1:5432 (CI must start it)")
        pytest.skip("PostgreSQL is not reachable at 127.0.0.1:5432")
    schema = f"t_{uuid.uuid4().hex[:12]}"
    return ["storage.records_url=postgresql+psycopg://postgres@127.0.0.1:5432/test",
            f"storage.records_schema={schema}"]


# ---------------------------------------------------------------------------------------------
# Tiny-model helpers shared by the trainer and objective tests.
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tok():
    """The tiny test tokenizer, built once per test module."""
    from reef_core.models.loading import build_tiny_tokenizer

    return build_tiny_tokenizer()
