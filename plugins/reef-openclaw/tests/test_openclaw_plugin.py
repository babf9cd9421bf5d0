"""reef-openclaw registers through the hooks, its recipe composes with the paper's defaults, its components build."""

import pytest

from reef_core.api import ConfigError, RecipeConfig, TrainerConfig, TrainerSetup, build_tiny_model
from reef_core.testing import PluginManager, available_recipes, compose_config
from reef_openclaw.options import OpenClawOptions
from reef_openclaw.prm import PRMJudge, PRMOptions
from reef_openclaw.processor import OpenClawProcessor


def test_openclaw_plugin_loads_and_registers_its_components():
    pm = PluginManager()
    assert "openclaw" in pm.info, pm.failures
    hooks = pm.info["openclaw"].hooks
    for hook in ("reef_config_searchpath", "reef_register_processors", "reef_register_judges",
                 "reef_register_trainers"):
        assert hook in hooks
    assert "pkg://reef_openclaw.conf" in pm.config_searchpath()
    assert set(pm.components["judge"]) >= {"prm", "callable"}
    assert "openclaw" in pm.components["processor"] and "openclaw" in pm.components["trainer"]


def test_openclaw_recipe_composes_with_the_paper_defaults():
    pm = PluginManager()
    assert "openclaw" in available_recipes(pm)
    cfg = compose_config(["+recipe=openclaw"], pm)
    r = cfg.recipe
    assert (r.name, r.processor, r.trainer, r.surface) == ("openclaw", "openclaw", "openclaw", "weights")
    assert r.options == {"batch_size": 16, "w_rl": 1.0, "w_opd": 1.0, "eps_clip": 0.2, "eps_clip_high": 0.28,
                         "adv_diff_clip": 1.0, "hint_selection": "sequence_optimal", "weight_decay": 0.1,
                         "adam_beta2": 0.98, "max_grad_norm": 1.0}
    p = r.processor_options
    assert (p["batch_size"], p["max_staleness"], p["session_ttl_s"], p["judge"]) == (16, 0, 900, "prm")
    assert p["judges"]["prm"] == {"model": None, "m": 3, "temperature": 0.6, "max_tokens": 8192, "timeout_s": 120.0,
                                  "concurrency": 8, "max_hint_candidates": 3}
    assert cfg.engine.top_k_logprobs == 4 and cfg.trainer.lr == 1e-5
    assert OpenClawOptions.from_options(r.options, p) == OpenClawOptions()
    assert PRMOptions.parse(p["judges"]["prm"]) == PRMOptions()


def test_tiny_profile_control_arm_and_command_line_judge():
    pm = PluginManager()
    cfg = compose_config(["+recipe=openclaw", "+openclaw_profile=tiny", "+openclaw_arm=control"], pm)
    assert cfg.recipe.options["batch_size"] == 16 and cfg.recipe.processor_options["batch_size"] == 16
    assert cfg.recipe.options["w_rl"] == 0.0 and cfg.recipe.options["w_opd"] == 0.0
    assert cfg.recipe.processor_options["judge"] == "reef_openclaw.examples.style:judge"
    assert cfg.engine.max_new_tokens == 4 and cfg.engine.top_k_logprobs == 4
    cfg = compose_config(["+recipe=openclaw", "recipe.judge=callable",
                          "+recipe.processor_options.judges.callable.function=reef_openclaw.examples.style:judge"], pm)
    proc = pm.create("processor", "openclaw", scenario="s", options=cfg.recipe.processor_options, create=pm.create,
                     serving_version=lambda: None)
    assert isinstance(proc, OpenClawProcessor) and proc.status()["openclaw"]["judge"]["kind"] == "callable"


def test_processor_and_trainer_refuse_bad_options():
    pm = PluginManager()
    with pytest.raises(ConfigError, match="no option 'judge_model'"):
        pm.create("processor", "openclaw", scenario="s", options={"judge_model": "x"})
    with pytest.raises(ConfigError, match="session_ttl_s"):
        pm.create("processor", "openclaw", scenario="s", options={"session_ttl_s": -1,
                                                                   "judge": "reef_openclaw.examples.style:judge"})
    with pytest.raises(ConfigError, match="served engine"):
        pm.create("processor", "openclaw", scenario="s", options={"judge": "prm"}, create=pm.create)
    setup = TrainerSetup(data_dir=None, load_base_model=build_tiny_model)
    with pytest.raises(ConfigError, match="unknown option .w_kl. in recipe.options"):
        pm.create("trainer", "openclaw", scenario="s", recipe=RecipeConfig(options={"w_kl": 1}),
                  trainer=TrainerConfig(), context=setup)
    with pytest.raises(ConfigError, match="must equal recipe.options.batch_size"):
        pm.create("trainer", "openclaw", scenario="s", recipe=RecipeConfig(options={"batch_size": 4},
                                                                          processor_options={"batch_size": 8}),
                  trainer=TrainerConfig(), context=setup)
    with pytest.raises(ConfigError, match="hint_selection"):
        pm.create("trainer", "openclaw", scenario="s", recipe=RecipeConfig(options={"hint_selection": "longest"}),
                  trainer=TrainerConfig(), context=setup)
    trainer = pm.create("trainer", "openclaw", scenario="s", recipe=RecipeConfig(options={"w_rl": 0, "w_opd": 0}),
                        trainer=TrainerConfig(), context=setup)
    assert trainer.name == "openclaw-control" and trainer.objective.needs_reference


def test_prm_judge_built_from_a_served_engine_stand_in():
    class Engine:  # what EngineChat needs to exist; never called here
        dialects = ["openai"]

    pm = PluginManager()
    judge = pm.create("judge", "prm", options={"m": 5}, engine=Engine())
    assert isinstance(judge, PRMJudge) and judge.options.m == 5
    judge.close()
