"""reef-gepa registers through the hooks and its recipe composes into a runnable GEPA deployment."""

import dataclasses

from reef_core.testing import PluginManager, available_recipes, compose_config
from reef_gepa.options import GepaOptions


def test_gepa_plugin_loads_and_registers_searchpath():
    pm = PluginManager()
    assert "gepa" in pm.info, pm.failures
    assert "reef_config_searchpath" in pm.info["gepa"].hooks
    assert "pkg://reef_gepa.conf" in pm.config_searchpath()
    assert pm.get("trainer", "gepa").plugin == "gepa"
    assert pm.get("surface", "harness").plugin == "reef_core.builtins.surfaces"


def test_gepa_recipe_composes():
    pm = PluginManager()
    assert "gepa" in available_recipes(pm)
    cfg = compose_config(["+recipe=gepa", "recipe.options.minibatch_size=4", "recipe.options.verifier=pkg.mod:fn"], pm)
    recipe = dataclasses.asdict(cfg.recipe)
    assert recipe["name"] == "gepa" and recipe["description"]
    assert (recipe["processor"], recipe["trainer"], recipe["surface"]) == ("per_report", "gepa", "harness")
    assert recipe["processor_options"] == {"batch_size": 4, "require_score": True}  # one batch = one minibatch
    assert recipe["surface_options"] == {"inject": "system", "system_files": ["system_prompt.md"]}
    assert cfg.evaluation.policy == "score_comparison" and cfg.evaluation.evaluator == "python"
    assert cfg.evaluation.options["evaluator"]["path"] == "pkg.mod:fn"  # the gate scores with GEPA's verifier
    opts = GepaOptions.from_config(cfg.recipe.options)
    assert opts.minibatch_size == 4 and opts.components == ["system_prompt.md"] and opts.use_merge is False
    # Every component the recipe names exists.
    for kind, name in (("processor", "per_report"), ("trainer", "gepa"), ("surface", "harness"),
                       ("evaluator", "python"), ("selection_policy", "score_comparison")):
        pm.get(kind, name)


def test_recipe_file_reads_gepa_defaults_instead_of_restating_them():
    from pathlib import Path

    import yaml

    defaults = {f.name: f.default for f in dataclasses.fields(GepaOptions)}
    path = Path(__file__).resolve().parents[1] / "reef_gepa" / "conf" / "recipe" / "gepa.yaml"
    options = yaml.safe_load(path.read_text())["recipe"]["options"]
    restated = {k: v for k, v in options.items() if k in defaults and v == defaults[k]}
    assert not restated, f"gepa.yaml restates GepaOptions defaults {restated}"
    # ... yet every knob stays overridable by name, with the dataclass's value in force.
    cfg = compose_config(["+recipe=gepa", "recipe.options.use_merge=true"], PluginManager())
    assert cfg.recipe.options["use_merge"] is True
    assert cfg.recipe.options["max_merge_invocations"] == GepaOptions.max_merge_invocations
