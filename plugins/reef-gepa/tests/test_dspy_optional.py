"""reef-gepa without its ``dspy`` extra: importing it, its GEPA trainer and its recipes never imports dspy, and a
config naming the ``dspy_gepa`` trainer fails at start-up naming the extra."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_WITHOUT_DSPY = textwrap.dedent("""
    import importlib.abc, sys

    class NoDspy(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in ("dspy", "litellm"):
                raise ImportError(f"{name} is not installed")

    if BLOCK:
        sys.meta_path.insert(0, NoDspy())
    import reef_gepa, reef_gepa.plugin, reef_gepa.trainer, reef_gepa.options, reef_gepa.dspy, reef_gepa.examples
    from reef_gepa.options import GepaOptions
    from reef_core.api import ConfigError
    from reef_core.testing import PluginManager, compose_config

    pm = PluginManager()
    assert "gepa" in pm.info, pm.failures
    pm.get("trainer", "gepa"), pm.get("trainer", "dspy_gepa")
    compose_config(["+recipe=gepa"], pm)
    cfg = compose_config(["+recipe=gepa_dspy"], pm)
    GepaOptions.from_config(compose_config(["+recipe=gepa"], pm).recipe.options)
    if BLOCK:
        from reef_core.config.recipes import check_components, recipe_bindings

        for binding in recipe_bindings(compose_config(["+recipe=gepa"], pm), pm).values():
            check_components(binding, pm)  # the plain recipe needs no dspy
        try:  # what `reef serve +recipe=gepa_dspy` checks at start-up (exit 2)
            for binding in recipe_bindings(cfg, pm).values():
                check_components(binding, pm)
        except ConfigError as exc:
            assert "trainer 'dspy_gepa' needs reef-gepa[dspy]" in str(exc), exc
        else:
            raise AssertionError("start-up accepted +recipe=gepa_dspy without dspy")
        from reef_gepa.dspy.trainer import make_trainer
        try:
            make_trainer(scenario="s", recipe=cfg.recipe, context=None)
        except ConfigError as exc:
            assert "reef-gepa[dspy]" in str(exc), exc
        else:
            raise AssertionError("the dspy_gepa trainer was built without dspy")
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("dspy", "litellm"))
    assert not leaked, leaked[:5]
    print("ok")
""")


def _run(block: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "REEF_LOAD_PLUGINS": "gepa"}
    return subprocess.run([sys.executable, "-c", f"BLOCK = {block}\n" + _WITHOUT_DSPY], capture_output=True,
                          text=True, env=env, timeout=120)


def test_reef_gepa_imports_without_dspy():
    result = _run(block=True)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_importing_reef_gepa_never_imports_dspy_when_installed():
    result = _run(block=False)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
