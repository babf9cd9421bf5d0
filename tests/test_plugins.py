"""Plugin loading: built-ins as plugins, conflicts, failures, allow/block lists, check_pending."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pluggy
import pytest

from reef_core import hookimpl
from reef_core.errors import ComponentConflict, UnknownComponent
from reef_core.plugins import DEFAULT_PLUGINS, PluginManager


def test_builtins_register_through_hooks():
    pm = PluginManager(load_entry_points=False)
    assert set(DEFAULT_PLUGINS) <= set(pm.info)
    assert all(pm.info[name].builtin for name in DEFAULT_PLUGINS)
    assert {"local", "upstream"} <= set(pm.components["engine"])
    assert pm.get("task", "dry_run").plugin == "reef_core.builtins.tasks"


def test_unknown_component_names_the_available_ones():
    pm = PluginManager(load_entry_points=False)
    with pytest.raises(UnknownComponent, match="available: .*local"):
        pm.get("engine", "nope")


class _PolicyA:
    @staticmethod
    @hookimpl
    def reef_register_selection_policies(register):
        register("coin", object)


class _PolicyB:
    @staticmethod
    @hookimpl
    def reef_register_selection_policies(register):
        register("coin", object)


def test_two_plugins_claiming_one_name_is_a_clear_error():
    pm = PluginManager(load_entry_points=False, extra_plugins=(_PolicyA, _PolicyB))
    with pytest.raises(ComponentConflict) as info:
        pm.components
    assert "_PolicyA" in str(info.value) and "_PolicyB" in str(info.value)


class _Misspelled:
    @staticmethod
    @hookimpl
    def reef_register_procesors(register):  # typo on purpose
        register("x", object)


def test_misspelled_hook_fails_loudly():
    with pytest.raises(pluggy.PluginValidationError, match="reef_register_procesors"):
        PluginManager(load_entry_points=False, extra_plugins=(_Misspelled,))


class _Raising:
    @staticmethod
    @hookimpl
    def reef_register_surfaces(register):
        raise RuntimeError("boom in registration")

    @staticmethod
    @hookimpl
    def reef_record_stored(record):
        raise RuntimeError("boom in lifecycle")


def test_failing_plugin_code_is_recorded_not_fatal():
    pm = PluginManager(load_entry_points=False, extra_plugins=(_Raising,))
    assert "local" in pm.components["engine"]
    assert "boom in registration" in pm.failures["_Raising"]
    pm.notify("reef_record_stored", record=object())  # logged, not raised


def _fake_dist(tmp_path, name, module_source, ep_name):
    """An installed distribution on sys.path: a module plus dist-info with a reef entry point."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(module_source))
    info = tmp_path / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[reef]\n{ep_name} = {name}\n")


def _reef(args, env_extra, tmp_path):
    import os

    env = {**os.environ, "PYTHONPATH": str(tmp_path), **env_extra}
    return subprocess.run([sys.executable, "-m", "reef_core.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_plugin_that_raises_on_import_is_listed_as_failed(tmp_path):
    _fake_dist(tmp_path, "reef_broken_plugin", "raise ImportError('this plugin is broken')\n", "broken")
    result = _reef(["plugins", "--json"], {}, tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    failed = {row["name"]: row["error"] for row in data["failed"]}
    assert "this plugin is broken" in failed["broken"]
    names = {row["name"] for row in data["plugins"]}
    assert "sao" in names  # the good plugins still load
    # And the rest of the CLI keeps working.
    assert _reef(["config", "server.port=9001"], {}, tmp_path).returncode == 0


def test_allow_and_block_lists(tmp_path):
    blocked = _reef(["plugins", "--json"], {"REEF_DISABLE_PLUGINS": "sao,gepa"}, tmp_path)
    names = {row["name"] for row in json.loads(blocked.stdout)["plugins"]}
    assert "sao" not in names and "gepa" not in names and "ttt" in names
    allowed = _reef(["plugins", "--json"], {"REEF_LOAD_PLUGINS": "gepa"}, tmp_path)
    names = {row["name"] for row in json.loads(allowed.stdout)["plugins"]}
    assert names == {"gepa"}
    recipes = _reef(["recipes", "--json"], {"REEF_LOAD_PLUGINS": "gepa"}, tmp_path)
    assert list(json.loads(recipes.stdout)) == ["gepa", "gepa_dspy"]


def test_trace_plugins_traces_registration_and_lifecycle_hooks(monkeypatch, caplog):
    """REEF_TRACE_PLUGINS logs every hook call, the registration hooks and the lifecycle hooks included
    (they are called through pluggy, one plugin at a time, never by calling the function directly)."""
    seen = []

    class Traced:
        @hookimpl
        def reef_register_processors(self, register):
            register("traced", lambda **_: None)

        @hookimpl
        def reef_report_accepted(self, record):
            seen.append(record)

    monkeypatch.setenv("REEF_TRACE_PLUGINS", "1")
    caplog.set_level("INFO", logger="reef.plugins")
    pm = PluginManager(load_entry_points=False, extra_plugins=(Traced(),))
    assert pm.get("processor", "traced").plugin.startswith("<")
    pm.notify("reef_report_accepted", record="s", references=[])
    assert seen == ["s"]
    traced = caplog.text
    assert "reef_register_processors" in traced and "reef_report_accepted" in traced
