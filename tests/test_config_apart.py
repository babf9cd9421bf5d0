"""``reef serve`` composes its config in a forked child process (reef_core/config/apart.py): the server gets the
same config as composing in-process, the same errors, runs its own loading meanwhile, and never loads Hydra,
OmegaConf, ANTLR or PyYAML (issue #41: RSS against LiteLLM's). The forking cases run in a fresh interpreter: a
pytest process may have threads running, and then the config is composed in-process (also tested)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from reef_core.config import apart
from reef_core.config.compose import compose_config
from reef_core.errors import ConfigError, ReefError


def _python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr
    return run


def test_the_forked_composition_is_the_in_process_one_and_the_meanwhile_runs_here(tmp_path):
    overrides = ["+recipe=sao", "server.port=8917", f"storage.data_dir={tmp_path}"]
    run = _python("""
        import dataclasses, json, os, sys
        from reef_core.config import apart

        assert apart.can_fork()
        here = []
        cfg = apart.compose_apart(sys.argv[1:], meanwhile=lambda: here.append(os.getpid()))
        loaded = sorted(m for m in ("hydra", "omegaconf", "antlr4", "yaml") if m in sys.modules)
        print(json.dumps({"cfg": dataclasses.asdict(cfg), "meanwhile": here == [os.getpid()], "loaded": loaded}))
    """, *overrides)
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["cfg"] == json.loads(json.dumps(dataclasses.asdict(compose_config(overrides))))
    assert out["cfg"]["recipe"]["name"] == "sao" and out["cfg"]["server"]["port"] == 8917
    assert out["meanwhile"] is True
    assert out["loaded"] == []


@pytest.mark.parametrize("override, message, detail", [
    ("+server.prot=1", "unknown key server.prot", ("key", "server.prot")),
    ("+recipe=nosuch", "unknown recipe 'nosuch'", ("available", None)),
    ("server.port=abc", "server.port", None),
])
def test_a_config_error_in_the_child_is_raised_here_as_composing_here_raises_it(override, message, detail):
    run = _python("""
        import json, sys
        from reef_core.config import apart
        from reef_core.errors import ConfigError

        try:
            apart.compose_apart(sys.argv[1:])
        except ConfigError as exc:
            print(json.dumps({"type": type(exc).__name__, "message": exc.message, "details": exc.details}))
    """, override)
    out = json.loads(run.stdout.splitlines()[-1])
    with pytest.raises(ConfigError) as here:
        compose_config([override])
    assert out["type"] == type(here.value).__name__
    assert out["message"] == here.value.message and message in out["message"]
    if detail is not None:
        key, value = detail
        assert out["details"][key] == (value if value is not None else here.value.details[key])


def test_a_child_that_ends_without_answering_is_an_error_naming_how_it_ended():
    run = _python("""
        import os
        from reef_core.config import apart
        from reef_core.errors import ReefError

        apart._child = lambda overrides, write_end: os._exit(3)
        try:
            apart.compose_apart([])
        except ReefError as exc:
            print(exc.message)
    """)
    assert run.stdout.strip().splitlines()[-1] == ("composing the config failed: its process ended without an "
                                                   "answer (exit status 3)")


def test_with_threads_running_the_config_is_composed_in_process(tmp_path):
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)
    thread.start()
    try:
        assert not apart.can_fork()
        pid = os.getpid()
        seen = []
        cfg = apart.compose_apart([f"storage.data_dir={tmp_path}"], meanwhile=lambda: seen.append(os.getpid()))
        assert seen == [pid] and cfg.storage.data_dir == str(tmp_path)
        with pytest.raises(ConfigError, match="unknown key server.prot"):
            apart.compose_apart(["+server.prot=1"])
    finally:
        stop.set()
        thread.join()


def test_the_childs_log_lines_are_shown_with_its_error_and_only_its_own_on_success(caplog):
    lines = [("reef.plugins", logging.WARNING, "plugin broken failed to load"),
             ("reef.config", logging.WARNING, "a note of the composition")]
    cfg = compose_config([])
    with caplog.at_level(logging.WARNING):
        assert apart._outcome(pickle.dumps(("config", cfg, lines)), 0) == cfg
    # On success the server loads the plugins itself and logs its own failures: the child's are not repeated.
    assert [(r.name, r.getMessage()) for r in caplog.records] == [("reef.config", "a note of the composition")]
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError, match="unknown recipe"):
        apart._outcome(pickle.dumps(("error", ConfigError("unknown recipe 'x'"), lines)), 0)
    assert [r.getMessage() for r in caplog.records] == [text for _, _, text in lines]
    with pytest.raises(RuntimeError, match="Traceback"):
        apart._outcome(pickle.dumps(("crash", "Traceback (most recent call last): ...", [])), 256)
    with pytest.raises(ReefError, match="signal 9"):
        apart._outcome(b"", signal.SIGKILL)


def test_reef_serve_loads_no_hydra_omegaconf_yaml_or_websocket_library(tmp_path):
    """The real command: `reef serve` on the upstream engine, its modules listed once it is ready (on SIGUSR1)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    listing = tmp_path / "modules.json"
    code = textwrap.dedent(f"""
        import json, signal, sys
        signal.signal(signal.SIGUSR1, lambda *_: open({str(listing)!r}, "w").write(json.dumps(sorted(sys.modules))))
        from reef_core.cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "engine.kind=upstream",
                             "engine.upstream_url=http://127.0.0.1:9/v1", f"storage.data_dir={tmp_path / 'data'}",
                             f"server.port={port}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline, "reef serve did not become ready in 60 s"
                time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
        while not listing.exists() or not listing.read_text().endswith("]"):
            assert proc.poll() is None and time.monotonic() < deadline, "no module listing"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    loaded = set(json.loads(Path(listing).read_text()))
    unwanted = {"hydra", "omegaconf", "antlr4", "yaml", "websockets", "alembic", "git", "torch"}
    assert sorted(unwanted & loaded) == []
    assert "reef_core.serve.app" in loaded  # the listing is the server's
