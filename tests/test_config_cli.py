"""Configuration composition and the reef CLI, run as a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from reef_core.config import compose_config, redacted


def reef(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "reef_core.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd, timeout=180)


def test_config_prints_resolved_port():
    result = reef("config", "+recipe=sao", "server.port=9001")
    assert result.returncode == 0, result.stderr
    cfg = yaml.safe_load(result.stdout)
    assert cfg["server"]["port"] == 9001
    assert cfg["recipe"]["name"] == "sao"


def test_unknown_recipe_exits_2_and_lists_recipes():
    result = reef("config", "+recipe=nope")
    assert result.returncode == 2
    assert "unknown recipe 'nope'" in result.stderr
    for name in ("sao", "gepa", "ttt", "openclaw", "skillclaw"):
        assert name in result.stderr


def test_bad_value_names_the_field():
    result = reef("config", "server.port=abc")
    assert result.returncode == 2
    assert "server.port" in result.stderr


def test_recipe_without_plus_is_explained():
    result = reef("config", "recipe=sao")
    assert result.returncode == 2
    # An installed recipe named without the '+': say what was meant, not "unknown recipe 'sao' ... sao ...".
    assert "unknown recipe" not in result.stderr, result.stderr
    assert "recipe=sao sets a key; select the recipe with +recipe=sao" in result.stderr, result.stderr
    # A name that is no recipe still lists the recipes, and says how one is selected.
    result = reef("config", "recipe=nope")
    assert result.returncode == 2
    assert "unknown recipe 'nope'" in result.stderr and "sao" in result.stderr and "+recipe=<name>" in result.stderr


def test_secrets_are_redacted():
    cfg = compose_config(["server.tokens=[s3cret-a,s3cret-b]", "engine.upstream_api_key=sk-x"])
    data = redacted(cfg)
    assert data["server"]["tokens"] == ["***", "***"]
    assert data["engine"]["upstream_api_key"] == "***"
    result = reef("config", "server.tokens=[s3cret-a]", "engine.upstream_api_key=sk-x")
    assert result.returncode == 0 and "s3cret" not in result.stdout and "sk-x" not in result.stdout


def test_version_and_usage_exit_codes():
    assert reef("--version").stdout.startswith("reef ")
    assert reef().returncode == 2
    assert reef("frobnicate").returncode == 2


def test_sweep_runs_four_jobs_with_four_resolved_configs(tmp_path):
    result = reef("sweep", "-m", "+recipe=sao,gepa", "seed=0,1", f"hydra.sweep.dir={tmp_path}/sweep",
                  "engine.model=tiny", cwd=tmp_path)
    assert result.returncode == 0, result.stderr + result.stdout
    resolved = sorted((tmp_path / "sweep").glob("*/resolved.yaml"))
    assert len(resolved) == 4
    combos = {(yaml.safe_load(p.read_text())["recipe"]["name"], yaml.safe_load(p.read_text())["seed"])
              for p in resolved}
    assert combos == {("sao", 0), ("sao", 1), ("gepa", 0), ("gepa", 1)}
    summaries = [json.loads(p.with_name("summary.json").read_text()) for p in resolved]
    assert all(s["task"] == "dry_run" for s in summaries)
    progress = [line for line in result.stderr.splitlines() if line.startswith("reef sweep: ")]
    assert [line.split(" (")[0] for line in progress] == [f"reef sweep: {i}/4 jobs" for i in range(1, 5)]
    assert all(line.endswith(" completed)") for line in progress)


def test_sweep_job_with_unknown_component_fails(tmp_path):
    result = reef("sweep", "-m", "engine.kind=nope", f"hydra.sweep.dir={tmp_path}/sweep", cwd=tmp_path)
    assert result.returncode != 0
    assert "no engine named 'nope'" in (result.stderr + result.stdout)


def test_third_party_recipe_package():
    # tests/fixtures/reef-example-thirdparty is pip-installed like a user would (see .ci/run).
    result = reef("recipes")
    assert "thumbs" in result.stdout
    result = reef("config", "+recipe=thumbs")
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["recipe"]["report_schema"] == "thumbs"
    plugins = json.loads(reef("plugins", "--json").stdout)
    example = next(p for p in plugins["plugins"] if p["name"] == "example")
    assert example["components"] == {"report_schema": ["thumbs"]}


def test_serve_refuses_a_weights_recipe_on_an_engine_that_cannot_swap(tmp_path):
    result = reef("serve", "+recipe=sao", "engine.kind=upstream", "engine.upstream_url=http://127.0.0.1:9",
                  f"storage.data_dir={tmp_path}", "server.port=0")  # refused whether 8900 is free or not
    assert result.returncode == 2
    assert "weights surface needs an engine that can swap weights" in result.stderr


def test_serve_refuses_a_public_bind_without_token(tmp_path):
    result = reef("serve", "server.host=0.0.0.0", f"storage.data_dir={tmp_path}")
    assert result.returncode == 2 and "refusing to bind 0.0.0.0" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the refusals of a machine without CUDA")
@pytest.mark.parametrize("override, names", [
    ("engine.device=cuda", "engine.device=cuda names a device this machine lacks"),
    ("engine.device=cuda:7", "engine.device=cuda:7 names a device this machine lacks"),
    ("engine.device=gpu", "engine.device must be one of auto, cpu, cuda, cuda:N, mps, not 'gpu'"),
    ("trainer.device=cuda:1", "trainer.device=cuda:1 names a device this machine lacks"),
])
def test_serve_refuses_a_device_the_machine_lacks(tmp_path, override, names):
    data_dir = tmp_path / "data"
    result = reef("serve", override, f"storage.data_dir={data_dir}")
    assert result.returncode == 2, result.stderr
    assert names in result.stderr and "Traceback" not in result.stderr
    if "lacks" in names:
        assert "available: cpu" in result.stderr
    assert not data_dir.exists()  # refused before anything was written


def test_serve_on_a_busy_port_fails_in_one_line_before_loading(tmp_path):
    import socket
    import time

    data_dir = tmp_path / "data"
    with socket.socket() as other:  # another process's server on the port
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        started = time.monotonic()
        result = reef("serve", f"server.port={port}", f"storage.data_dir={data_dir}")
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [f"reef: error: port {port} is already in use on 127.0.0.1 (another process listens there); "
                     "stop it, or choose another port with server.port=N"], result.stderr
    assert not data_dir.exists()  # refused before the deployment (and its model) was built
    assert time.monotonic() - started < 60


def test_serve_help_lists_sections_keys_defaults_and_groups():
    """Issue #37: `reef serve --help` lists the config groups and the most-used keys with their defaults, generated
    from the schema, the default config and the installed recipe packages."""
    import dataclasses

    from reef_core.config import available_recipes
    from reef_core.config.help import COMMON_KEYS
    from reef_core.config.schema import ReefConfig

    result = reef("serve", "--help")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("usage: reef serve") and "Traceback" not in result.stderr
    cfg = compose_config([])
    sections = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ReefConfig)
                if dataclasses.is_dataclass(getattr(cfg, f.name))}
    for section, keys in COMMON_KEYS.items():  # the chosen keys are the schema's, shown with the defaults
        assert section in sections, section
        names = {f.name for f in dataclasses.fields(sections[section])}
        assert set(keys) <= names, (section, set(keys) - names)
    for section in sections:
        assert f"\n  {section} " in out, section
    for shown in ("host=127.0.0.1", f"port={cfg.server.port}", f"data_dir={cfg.storage.data_dir}",
                  f"kind={cfg.engine.kind}", f"model={cfg.engine.model}",
                  f"max_new_tokens={cfg.engine.max_new_tokens}", "(+"):
        assert shown in out, shown
    for recipe in available_recipes():
        assert recipe in out, recipe
    assert "+recipe=" in out and "+sao_profile=" in out and "tiny_grpo" in out and "(after +recipe=sao)" in out
    assert reef("serve", "-h").stdout == out
