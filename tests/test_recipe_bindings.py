"""Every recipe section is per recipe: routed recipes compose their own sections plus their route's overrides."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from reef_core import hookimpl
from reef_core.config import compose_config
from reef_core.config.recipes import recipe_bindings
from reef_core.errors import ConfigError, UnknownComponent
from reef_core.observe.records import Scenario
from reef_core.plugins import PluginManager
from reef_core.surfaces.base import Surface

RECIPES = Path(__file__).resolve().parent / "fixtures" / "duo-recipes"


class FakeWeights(Surface):
    """A weights surface that needs no engine (the deployment's rule about weights surfaces is what is tested)."""

    kind = "weights"

    def __init__(self, options):
        self.options = options


class DuoConfig:
    @staticmethod
    @hookimpl
    def reef_config_searchpath():
        return f"file://{RECIPES}"

    @staticmethod
    @hookimpl
    def reef_register_trainers(register):
        register("duo_torch", lambda **_: None)
        register("duo_prompts", lambda **_: None)

    @staticmethod
    @hookimpl
    def reef_register_surfaces(register):
        register("fake_weights", lambda *, ports=None, options=None: FakeWeights(options))


@pytest.fixture(scope="module")
def pm():
    return PluginManager(load_entry_points=False, extra_plugins=(DuoConfig,))


def _quoted(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def routes(*entries: tuple) -> str:
    """A ``routes=[...]`` override (Hydra's grammar) from ``(pattern, recipe[, overrides])`` tuples."""
    items = []
    for pattern, recipe, *rest in entries:
        overrides = ", ".join(_quoted(o) for o in (rest[0] if rest else []))
        items.append(f"{{pattern: {_quoted(pattern)}, recipe: {_quoted(recipe)}, overrides: [{overrides}]}}")
    return f"routes=[{', '.join(items)}]"


def test_a_routed_recipe_gets_its_own_sections_and_its_route_overrides(pm):
    cfg = compose_config(["+recipe=duo_harness", "trainer.lr=0.5", "evaluation.publish=review",
                          "trainer.learner_workers=3",
                          routes(("math-*", "duo_weights", ["trainer.lora=true", "evaluation.policy=score_comparison",
                                                            "+recipe.processor_options.max_staleness=3"]))], pm)
    bindings = recipe_bindings(cfg, pm)
    assert set(bindings) == {"duo_harness", "duo_weights"}
    default, routed = bindings["duo_harness"], bindings["duo_weights"]
    # The default recipe takes the top-level sections, command-line overrides included.
    assert default.default and default.trainer.lr == 0.5 and default.evaluation.publish == "review"
    assert default.evaluation.policy == "floor"  # its own file's gate, composed at the top level
    # The routed one: its file's sections, its route's overrides, none of the top level's.
    assert not routed.default and routed.patterns == ("math-*",)
    assert routed.trainer.lr == 1.0e-3 and routed.trainer.lora is True
    assert routed.evaluation.policy == "score_comparison" and routed.evaluation.publish == "auto"
    assert routed.config.processor_options == {"batch_size": 1, "max_staleness": 3}
    assert routed.config.surface == "weights"
    assert routed.trainer.learner_workers == 3  # deployment-wide: the value in force


def test_real_recipes_keep_their_gate_and_trainer_sections_when_routed():
    # GEPA's gate (python evaluator with its verifier, score_comparison) and SAO's trainer choices (LoRA) used to
    # be read from the top level for routed scenarios; each now comes with its recipe.
    cfg = compose_config(["+recipe=sao", "routes=[{pattern: 'support-*', recipe: gepa}]"])
    bindings = recipe_bindings(cfg)
    gepa, sao = bindings["gepa"], bindings["sao"]
    assert (gepa.evaluation.policy, gepa.evaluation.evaluator) == ("score_comparison", "python")
    assert gepa.evaluation.options["evaluator"]["path"] == gepa.config.options["verifier"]
    assert gepa.trainer.grad_accumulation == 1 and gepa.config.surface_options["inject"] == "system"
    assert (sao.evaluation.policy, sao.evaluation.evaluator) == ("always", None)
    assert sao.trainer.lora is True and sao.trainer.lora_layers == 8


@pytest.mark.parametrize("override, key", [
    ("engine.model=tiny", "engine.model"), ("server.port=1", "server.port"), ("storage.data_dir=/x", "storage.data_dir"),
    ("seed=3", "seed"), ("+learn.rollouts=2", "learn.rollouts"), ("task=learn", "task"),
    ("hydra.searchpath=[file:///x]", "hydra.searchpath"), ("recipe=gepa", "recipe"), ("recipe.name=x", "recipe.name"),
    ("trainer.learner_workers=9", "trainer.learner_workers"),
])
def test_a_route_may_not_override_deployment_wide_keys(pm, override, key):
    cfg = compose_config([routes(("*", "duo_weights"), ("m-*", "duo_harness", ["trainer.lr=0.1", override]))], pm)
    with pytest.raises(ConfigError) as caught:
        recipe_bindings(cfg, pm)
    assert "routes[1]" in caught.value.message and "'m-*'" in caught.value.message
    assert repr(key) in caught.value.message


def test_a_route_override_is_validated_like_the_command_line(pm):
    cfg = compose_config([routes(("m-*", "duo_weights", ["trainer.lr=fast"]))], pm)
    with pytest.raises(ConfigError, match=r"routes\[0\].*trainer\.lr"):
        recipe_bindings(cfg, pm)
    cfg = compose_config([routes(("m-*", "duo_weights", ["trainer.lr="]))], pm)  # not a parseable override
    with pytest.raises(ConfigError, match=r"routes\[0\]"):
        recipe_bindings(cfg, pm)
    cfg = compose_config([routes(("m-*", "no_such_recipe"))], pm)
    with pytest.raises(ConfigError, match=r"routes\[0\].*unknown recipe 'no_such_recipe'"):
        recipe_bindings(cfg, pm)
    cfg = compose_config([routes(("m-*", ""))], pm)
    with pytest.raises(ConfigError, match=r"routes\[0\]\.recipe"):
        recipe_bindings(cfg, pm)
    cfg = compose_config([routes(("m-*", "duo_weights", ["evaluation.publish=later"]))], pm)
    with pytest.raises(ConfigError, match=r"evaluation\.publish of recipe 'duo_weights'.*'m-\*'"):
        recipe_bindings(cfg, pm)


def test_routes_naming_one_recipe_share_its_composition(pm):
    cfg = compose_config(["+recipe=duo_harness", routes(("a-*", "duo_weights", ["trainer.lora=true"]),
                                                         ("b-*", "duo_weights", ["trainer.lora=true"]),
                                                         ("c-*", "duo_harness"))], pm)
    bindings = recipe_bindings(cfg, pm)
    assert bindings["duo_weights"].patterns == ("a-*", "b-*")
    assert bindings["duo_harness"].default and bindings["duo_harness"].patterns == ("c-*",)
    # Different overrides for one recipe, or overrides for the default recipe, have no single meaning.
    cfg = compose_config([routes(("a-*", "duo_weights", ["trainer.lora=true"]), ("b-*", "duo_weights"))], pm)
    with pytest.raises(ConfigError, match=r"routes\[1\].*overrides must agree"):
        recipe_bindings(cfg, pm)
    cfg = compose_config(["+recipe=duo_harness", routes(("c-*", "duo_harness", ["trainer.lr=1"]))], pm)
    with pytest.raises(ConfigError, match=r"routes\[0\].*default recipe"):
        recipe_bindings(cfg, pm)


def _deployment(tmp_path, pm, *overrides):
    from reef_core.loop.assemble import build_deployment

    cfg = compose_config(["engine.kind=upstream", "engine.upstream_url=http://127.0.0.1:9",
                          f"storage.data_dir={tmp_path}", *overrides], pm)
    return build_deployment(cfg, pm)


def test_learners_get_their_recipes_settings_and_surfaces_their_options(tmp_path, pm):
    dep = _deployment(tmp_path, pm, "+recipe=duo_harness", "evaluation.publish=review",
                      routes(("plain-*", "duo_harness"),
                             ("quiet-*", "duo_weights", ["recipe.surface=harness",
                                                         "+recipe.surface_options.inject=none",
                                                         "evaluation.policy=floor",
                                                         "+evaluation.options.policy.floor_score=0.9"])))
    try:
        default = Scenario(name="loud", recipe="duo_harness", created_at=time.time())
        quiet = Scenario(name="quiet-1", recipe="duo_weights", created_at=time.time())
        assert dep.recipe_for_new_scenario("quiet-1") == "duo_weights"
        assert dep.recipe_for_new_scenario("plain-1") == "duo_harness"
        assert dep.settings_for(default).evaluation.publish == "review"
        assert dep.settings_for(quiet).evaluation.publish == "auto"
        assert dep.settings_for(quiet).evaluation.policy == "floor"
        assert dep.settings_for(quiet).evaluation.options == {"policy": {"floor_score": 0.9}}
        assert dep.settings_for(default).evaluation.options == {"policy": {"floor_score": 2.0}}
        assert dep.settings_for(quiet).trainer.lr == 1.0e-3 and dep.settings_for(default).trainer.lr == 1.0e-6
        # One harness surface per set of options: each recipe's injection holds.
        loud_surface, quiet_surface = dep.surface_for(default), dep.surface_for(quiet)
        assert loud_surface is not quiet_surface
        assert (loud_surface.inject, quiet_surface.inject) == ("system", "none")
        assert dep.surface("harness", {"inject": "system"}) is loud_surface  # built once, found again
    finally:
        dep.store.close()


def test_one_weights_surface_per_deployment(tmp_path, pm):
    weights = ["recipe.surface=fake_weights"]
    # Same surface, same options (duo_harness's inject option deleted): one instance.
    dep = _deployment(tmp_path, pm, "+recipe=duo_weights", *weights,
                      routes(("w-*", "duo_harness", [*weights, "~recipe.surface_options.inject"])))
    try:
        a = Scenario(name="a", recipe="duo_weights", created_at=time.time())
        b = Scenario(name="w-1", recipe="duo_harness", created_at=time.time())
        assert dep.surface_for(a) is dep.surface_for(b)
    finally:
        dep.store.close()
    with pytest.raises(ConfigError, match="one set of weights"):
        _deployment(tmp_path / "other", pm, "+recipe=duo_weights", *weights,
                    routes(("w-*", "duo_harness", weights)))  # inject: system, unlike duo_weights


def test_start_up_checks_each_routed_recipes_components(tmp_path, pm):
    with pytest.raises(UnknownComponent, match=r"'m-\*'.*evaluation\.policy.*no selection policy named 'nope'"):
        _deployment(tmp_path, pm, routes(("m-*", "duo_harness", ["evaluation.policy=nope"])))
    with pytest.raises(ConfigError, match=r"'m-\*'.*trainer\.device"):
        _deployment(tmp_path / "b", pm, routes(("m-*", "duo_harness", ["trainer.device=cuda:99"])))


def test_dry_run_checks_routed_recipes(tmp_path, pm, monkeypatch):
    from reef_core.builtins import tasks

    monkeypatch.setattr("reef_core.plugins.get_plugin_manager", lambda: pm)
    cfg = compose_config(["+recipe=duo_harness", routes(("m-*", "duo_weights", ["evaluation.policy=floor"]))], pm)
    summary = tasks.dry_run(cfg, tmp_path)
    assert summary["components"]["selection_policy"] == "floor" and summary["components"]["trainer"] == "duo_prompts"
    assert summary["routed_recipes"]["duo_weights"] == {
        "patterns": ["m-*"], "components": {"processor": "per_report", "trainer": "duo_torch", "surface": "weights",
                                            "selection_policy": "floor"}}
    cfg = compose_config([routes(("m-*", "duo_weights", ["recipe.processor=nope"]))], pm)
    with pytest.raises(UnknownComponent, match=r"'m-\*'.*recipe\.processor"):
        tasks.dry_run(cfg, tmp_path / "bad")


def test_reef_config_shows_what_a_routed_recipe_runs_with():
    def reef(*args):
        return subprocess.run([sys.executable, "-m", "reef_core.cli", *args], capture_output=True, text=True,
                              timeout=180)

    result = reef("config", "+recipe=gepa", "trainer.lr=0.5",
                  "routes=[{pattern: 'math-*', recipe: sao, overrides: ['trainer.lora=true']}]")
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["trainer"]["lr"] == 0.5
    sao = shown["routed_recipes"]["sao"]
    assert sao["patterns"] == ["math-*"] and sao["overrides"] == ["trainer.lora=true"]
    assert sao["trainer"]["lora"] is True and sao["trainer"]["lr"] == 2.0e-3
    assert sao["trainer"]["lora_layers"] == 8 and sao["recipe"]["trainer"] == "sao"
    refused = reef("config", "routes=[{pattern: 'math-*', recipe: sao, overrides: ['engine.model=tiny']}]")
    assert refused.returncode == 2 and "routes[0]" in refused.stderr and "'engine.model'" in refused.stderr
