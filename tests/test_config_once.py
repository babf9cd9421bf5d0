"""Config is composed once into plain, typed objects, and every knob has one default."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml
from omegaconf import Container

from reef_core.config import compose_config
from reef_core.config.schema import RecipeConfig, ReefConfig, TrainerConfig
from reef_core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def omegaconf_nodes(node, where: str = "cfg") -> list[str]:
    """Paths inside ``node`` that hold an OmegaConf container (DictConfig, ListConfig), walked recursively."""
    if isinstance(node, Container):
        return [where]
    if dataclasses.is_dataclass(node):
        return [p for f in dataclasses.fields(node) for p in omegaconf_nodes(getattr(node, f.name), f"{where}.{f.name}")]
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in omegaconf_nodes(v, f"{where}.{k}")]
    if isinstance(node, (list, tuple)):
        return [p for i, v in enumerate(node) for p in omegaconf_nodes(v, f"{where}[{i}]")]
    return []


def test_the_walker_finds_a_nested_omegaconf_node():
    from omegaconf import OmegaConf

    assert omegaconf_nodes(RecipeConfig(options={"a": [1, {"b": OmegaConf.create([1])}]})) == ["cfg.options.a[1].b"]


def test_the_deployment_gets_a_plain_dataclass_tree(tmp_path):
    from reef_core.loop.assemble import build_deployment

    cfg = compose_config(["+recipe=gepa", "engine.kind=upstream", "engine.upstream_url=http://127.0.0.1:9",
                          f"storage.data_dir={tmp_path}", "routes=[{pattern: 'sk-*', recipe: skillclaw}]"])
    dep = build_deployment(cfg)
    try:
        assert type(dep.cfg) is ReefConfig and type(dep.cfg.trainer) is TrainerConfig
        assert omegaconf_nodes(dep.cfg) == []
        # The recipe sections of routed recipes are composed separately: they are plain too.
        assert set(dep.recipes) == {"gepa", "skillclaw"}
        for binding in dep.recipes.values():
            assert type(binding.config) is RecipeConfig and omegaconf_nodes(binding.config) == []
        # Free-form option sections are ordinary dicts and lists, interpolations resolved.
        gepa = dep.recipes["gepa"].config
        assert type(gepa.options) is dict and type(gepa.options["components"]) is list
        assert gepa.processor_options["batch_size"] == gepa.options["minibatch_size"]
    finally:
        dep.store.close()


def test_environment_fills_survive_the_conversion(monkeypatch):
    monkeypatch.setenv("REEF_SAO_BATCH_SIZE", "32")
    cfg = compose_config(["+recipe=sao"])
    assert cfg.recipe.options["batch_size"] == 32 and cfg.recipe.processor_options["batch_size"] == 32


def test_a_missing_option_default_names_the_field(tmp_path):
    from reef_core.config.schema import option_default

    class Node:
        def _key(self):
            return "no_such_knob"

    with pytest.raises(ConfigError, match="no_such_knob"):
        option_default("reef_core.config.schema:TrainerConfig", _node_=Node())


# -- one default per knob -----------------------------------------------------------------------------------------

class _Spy:
    """Stands in for TorchTrainer.__init__: records the options from_config hands over, as the fields it set (those
    not at TorchTrainerOptions' own defaults, and the evaluation engine's, which it always sets)."""

    EVAL = ("eval_model_dir", "eval_max_new_tokens", "eval_generation")

    def __init__(self, objective, load_base_model, options=None, **rest):
        from reef_core.grow.torch_backend import TorchTrainerOptions

        plain = TorchTrainerOptions()
        self.settings = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
                         if f.name in _Spy.EVAL or getattr(options, f.name) != getattr(plain, f.name)}


def _spy_trainer_class():
    from reef_core.grow.torch_backend import TorchTrainer

    return type("SpyTrainer", (TorchTrainer,), {"__init__": _Spy.__init__})


def test_torch_trainer_takes_every_backend_knob_from_the_trainer_section():
    from reef_core.grow.trainer import TrainerSetup

    section = TrainerConfig(lr=0.125, lora=True, lora_rank=3, lora_alpha=5, lora_layers=4, grad_accumulation=2,
                            device="meta")
    setup = TrainerSetup(data_dir=None, load_base_model=lambda: None, seed=7)
    built = _spy_trainer_class().from_config(object(), setup, section, who="test")
    knobs = {"lr": 0.125, "lora": True, "lora_rank": 3, "lora_alpha": 5, "lora_layers": 4, "grad_accumulation": 2,
             "device": "meta", "seed": 7}
    assert {k: built.settings[k] for k in knobs} == knobs
    # The rest is the gate's private evaluation engine, from the engine (none here) and evaluation sections.
    assert set(built.settings) - set(knobs) == {"eval_model_dir", "eval_max_new_tokens", "eval_generation"}
    assert built.settings["eval_model_dir"] is None


def test_torch_trainer_defaults_are_the_trainer_sections():
    """TorchTrainer's own defaults (TorchTrainerOptions') are read from TrainerConfig, not restated (the same
    objects)."""
    from reef_core.grow.torch_backend import TorchTrainerOptions

    params = {f.name: f for f in dataclasses.fields(TorchTrainerOptions)}
    defaults = {f.name: f.default for f in dataclasses.fields(TrainerConfig)}
    for knob in ("lr", "lora", "lora_rank", "lora_alpha", "lora_layers", "grad_accumulation", "device"):
        assert params[knob].default is defaults[knob], knob


def test_recipe_files_do_not_restate_trainer_section_defaults():
    """A recipe file layers on the schema directly (profiles layer on a recipe and may reset its choices)."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainerConfig)}
    files = sorted(ROOT.glob("plugins/*/reef_*/conf/recipe/*.yaml"))
    assert files
    for path in files:
        section = (yaml.safe_load(path.read_text()) or {}).get("trainer") or {}
        restated = {k: v for k, v in section.items() if k in defaults and v == defaults[k]}
        assert not restated, f"{path.relative_to(ROOT)} restates trainer defaults {restated}"
