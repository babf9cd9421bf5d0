"""reef-sao registers through the hooks, its configs compose, its options and reports are validated."""

from __future__ import annotations

import dataclasses

import pytest

from reef_core.api import (
    ConfigError,
    RecipeConfig,
    TrainerConfig,
    TrainerSetup,
    ValidationFailed,
    build_tiny_model,
    build_tiny_tokenizer,
)
from reef_core.testing import PluginManager, available_recipes, compose_config
from reef_sao.objectives import GRPODISObjective, SAOObjective, objective_for
from reef_sao.schema import validate_sao_report
from reef_sao.tasks import MAX_TOKENS, Task, letter_share, score, task_stream, variety
from reef_sao.trainer import SAOOptions

#: sao.yaml's shipped choices for the default deployment (SmolLM2 on CPU; see its header).
LR, CRITIC_LR, BATCH, GRAD_ACCUMULATION = 2e-3, 2e-4, 4, 1


@pytest.fixture(scope="module")
def pm():
    return PluginManager()


def test_sao_plugin_loads_and_registers_components(pm):
    assert "sao" in pm.info, pm.failures
    assert {"reef_config_searchpath", "reef_register_trainers", "reef_register_report_schemas"} <= set(
        pm.info["sao"].hooks)
    assert "pkg://reef_sao.conf" in pm.config_searchpath()
    assert pm.get("trainer", "sao").plugin == "sao"
    assert pm.get("report_schema", "sao").plugin == "sao"


def test_sao_recipe_composes_with_the_paper_knobs(pm):
    assert "sao" in set(available_recipes(pm))
    cfg = compose_config(["+recipe=sao"], pm)
    recipe = dataclasses.asdict(cfg.recipe)
    assert (recipe["name"], recipe["processor"], recipe["trainer"], recipe["surface"], recipe["report_schema"]) == (
        "sao", "per_report", "sao", "weights", "sao")
    opts = recipe["options"]
    assert (opts["eps_clip"], opts["eps_clip_high"], opts["critic_steps_per_actor"], opts["lambda_alpha"],
            opts["critic_lambda"], opts["gamma"]) == (0.3, 5.0, 2, 1.5, 1.0, 1.0)
    assert recipe["processor_options"] == {"batch_size": opts["batch_size"], "max_staleness": 2}
    assert opts["batch_size"] % cfg.trainer.grad_accumulation == 0
    assert cfg.engine.model == "smollm2"  # the README's main command runs SmolLM2 on CPU
    # The CPU choices sao.yaml's header states (each with the paper's value to restore): LoRA adapters on the last
    # 8 layers for the policy and the critic, learning rates for adapters, short replies, one thread.
    assert (cfg.trainer.lora, cfg.trainer.lora_layers, opts["critic_lora"]) == (True, 8, True)
    assert (cfg.trainer.lr, cfg.trainer.critic_lr, opts["critic_lr"]) == (LR, CRITIC_LR, CRITIC_LR)
    assert (opts["batch_size"], cfg.trainer.grad_accumulation) == (BATCH, GRAD_ACCUMULATION)
    # Ordinary answers finish (256); the example task's requests set its own short budget (issue #37).
    assert (cfg.engine.max_new_tokens, cfg.engine.num_threads) == (256, 1)
    assert cfg.learn.max_tokens == MAX_TOKENS == 24
    SAOOptions.from_options(recipe["options"], recipe["processor_options"])  # valid as shipped


def test_the_paper_values_restore_with_the_overrides_the_header_names(pm):
    cfg = compose_config(["+recipe=sao", "trainer.lora=false", "recipe.options.critic_lora=false",
                          "trainer.lora_layers=null", "trainer.lr=1e-6", "trainer.critic_lr=5e-6"], pm)
    assert (cfg.trainer.lora, cfg.trainer.lora_layers, cfg.recipe.options["critic_lora"]) == (False, None, False)
    assert (cfg.trainer.lr, cfg.recipe.options["critic_lr"]) == (1e-6, 5e-6)
    assert SAOOptions.from_options(cfg.recipe.options).critic_lora is False


def test_batch_size_follows_the_environment(pm, monkeypatch):
    monkeypatch.setenv("REEF_SAO_BATCH_SIZE", "128")
    cfg = compose_config(["+recipe=sao"], pm)
    assert cfg.recipe.options["batch_size"] == 128 and cfg.recipe.processor_options["batch_size"] == 128


def test_tiny_profile_and_grpo_control_compose(pm):
    cfg = compose_config(["+recipe=sao", "+sao_profile=tiny"], pm)
    assert cfg.engine.model == "tiny" and cfg.engine.max_new_tokens == 8
    assert cfg.recipe.options["batch_size"] == 4 and cfg.recipe.processor_options["batch_size"] == 4
    assert cfg.trainer.grad_accumulation == 1
    # full weights: the tiny model has 2 layers, none of the recipe's LoRA choices apply
    assert (cfg.trainer.lora, cfg.trainer.lora_layers, cfg.recipe.options["critic_lora"]) == (False, None, False)
    grpo = compose_config(["+recipe=sao", "+sao_arm=grpo", "+sao_profile=tiny_grpo"], pm)
    opts = dataclasses.asdict(grpo.recipe)
    assert opts["processor"] == "grouped" and opts["options"]["advantage"] == "grpo"
    SAOOptions.from_options(opts["options"], opts["processor_options"])
    # the processors accept the composed processor options as they are
    for c in (cfg, grpo):
        pm.create("processor", c.recipe.processor, scenario="s", options=c.recipe.processor_options,
                  serving_version=lambda: "base")


@pytest.mark.parametrize("options, message", [
    ({"eps_clip": 0.3}, "eps_clip_high must be set explicitly"),
    ({"eps_clip": 1.0, "eps_clip_high": 5.0}, r"eps_clip must lie in \[0, 1\)"),
    ({"eps_clip": 0.3, "eps_clip_high": 0}, "eps_clip_high must be positive"),
    ({"eps_clip_high": 5.0, "critic_steps_per_actor": 0}, "critic_steps_per_actor"),
    ({"eps_clip_high": 5.0, "advantage": "ppo"}, "advantage must be one of"),
    ({"eps_clip_high": 5.0, "eps_clip_hihg": 5.0}, "unknown option 'eps_clip_hihg'"),
    ({"eps_clip_high": 5.0, "advantage": "grpo", "batch_size": 6}, "multiple of group_size"),
    ({"eps_clip_high": 5.0, "critic_lambda": 1.5}, r"critic_lambda must lie in \[0, 1\]"),
    ({"eps_clip_high": 5.0, "batch_size": 0}, "batch_size must be a positive integer"),
    ({"eps_clip_high": 5.0, "critic_lora": "yes"}, "critic_lora must be true or false"),
])
def test_options_are_validated_at_construction(options, message):
    with pytest.raises(ConfigError, match=message):
        objective_for(SAOOptions.from_options({"batch_size": 4, **options}), critic_lr=1e-3)


def test_kebab_case_options_and_processor_consistency():
    opts = SAOOptions.from_options({"eps-clip-high": 3.0, "eps-clip": 0.8, "batch-size": 8, "max-staleness": 18})
    assert (opts.eps_clip, opts.eps_clip_high, opts.batch_size) == (0.8, 3.0, 8)
    with pytest.raises(ConfigError, match="processor's batch_size"):
        SAOOptions.from_options({"eps_clip_high": 5.0, "batch_size": 8}, {"batch_size": 4})
    with pytest.raises(ConfigError, match="groups_per_batch"):
        SAOOptions.from_options({"eps_clip_high": 5.0, "advantage": "grpo", "batch_size": 8},
                                {"group_size": 4, "groups_per_batch": 4})


def test_trainer_factory_builds_both_arms_and_checks_the_backend(pm, tmp_path):
    tok = build_tiny_tokenizer()
    setup = TrainerSetup(data_dir=tmp_path, load_base_model=lambda: build_tiny_model(seed=0, tokenizer=tok))
    trainer_section = TrainerConfig(backend="torch", lr=1e-3, critic_lr=2e-3, grad_accumulation=2, device="cpu")
    recipe = RecipeConfig(options={"batch_size": 4, "eps_clip": 0.3, "eps_clip_high": 5.0})
    sao = pm.create("trainer", "sao", scenario="s", recipe=recipe, trainer=trainer_section, context=setup)
    assert isinstance(sao.objective, SAOObjective) and sao.objective.critic_lr == 2e-3
    assert sao.grad_accumulation == 2 and sao.artifact_kind == "weights"
    grpo = pm.create("trainer", "sao", scenario="s", recipe=RecipeConfig(options={**recipe.options, "advantage": "grpo"}),
                     trainer=trainer_section, context=setup)
    assert isinstance(grpo.objective, GRPODISObjective)
    with pytest.raises(ConfigError, match="unknown trainer.backend .jax."):
        pm.create("trainer", "sao", scenario="s", recipe=recipe, trainer=dataclasses.replace(trainer_section, backend="jax"),
                  context=setup)
    with pytest.raises(ConfigError, match="multiple of trainer.grad_accumulation"):
        pm.create("trainer", "sao", scenario="s", recipe=recipe, trainer=dataclasses.replace(trainer_section, grad_accumulation=3),
                  context=setup)
    # The built-in `torch` trainer runs any objective named by dotted path.
    from reef_core.testing import builtin_trainers as builtin

    with_builtin = PluginManager(load_entry_points=False, extra_plugins=(builtin,))
    plain = with_builtin.create(
        "trainer", "torch", scenario="s", trainer=trainer_section, context=setup,
        recipe=RecipeConfig(options={"objective": "reef_sao.objectives:GRPODISObjective",
                                     "objective_options": {"eps_clip": 0.3, "eps_clip_high": 5.0}}))
    assert isinstance(plain.objective, GRPODISObjective)
    with pytest.raises(ConfigError, match="objective"):
        with_builtin.create("trainer", "torch", scenario="s", recipe=RecipeConfig(), trainer=trainer_section,
                            context=setup)


def test_report_schema_accepts_one_scored_rollout_and_explains_refusals(pm):
    validate = pm.create("report_schema", "sao")
    ok = {"score": 0.5, "references": ["rec-1"], "metadata": {}}
    assert validate(ok) is ok and validate({"score": 1, "references": ["r"]})
    for bad, message in [
        ({"references": ["r"]}, "needs a numeric 'score'"),
        ({"score": True, "references": ["r"]}, "must be a number"),
        ({"score": "1", "references": ["r"]}, "must be a number"),
        ({"score": float("nan"), "references": ["r"]}, "finite"),
        ({"score": float("inf"), "references": ["r"]}, "finite"),
        ({"score": 1.0, "references": []}, r"exactly one receipt .* \(got 0\)"),
        ({"score": 1.0, "references": ["a", "b"]}, r"\(got 2\)"),
        ({"score": 1.0}, "exactly one receipt"),
        ({"score": 1.0, "references": [""]}, "non-empty receipt"),
    ]:
        with pytest.raises(ValidationFailed, match=message) as info:
            validate_sao_report(bad)
        assert info.value.status == 400


def test_task_stream_is_deterministic_and_the_verifier_is_exact():
    a, b = list(task_stream(20, seed=3)), list(task_stream(20, seed=3))
    assert a == b and len({t.prompt for t in a}) > 3 and a != list(task_stream(20, seed=4))
    task = Task("t", "reply", alphabet="aeiou")
    assert score(task, "") == 0.0 and score(task, "   ") == 0.0 and score(task, "xyz") == 0.0
    assert score(task, "aeiou") == 1.0 and score(task, "a e i o u") == 1.0 and score(task, "Oui") == 1.0
    assert score(task, "oui, eau") == pytest.approx(6 / 7)  # blanks are free, punctuation counts against
    assert letter_share(task, "a e") == pytest.approx(2 / 3)  # the old signal: blanks counted against
    assert task.messages() == [{"role": "user", "content": "reply"}]


@pytest.mark.parametrize("reply", [" release" * 8, "ion" * 8, "uestion" * 8, "a" * 24, "a e i o u " * 5,
                                   "aeiou" * 5])
def test_repetition_does_not_pay(reply):
    """The optima that earlier verifiers let a policy reach (results/2026-12-03-sao-tiny/samples.md) now score
    below half of what the plain short answer scores, and below their old letter share."""
    task = Task("t", "reply", alphabet="aeiou")
    assert score(task, reply) < 0.5 * score(task, "aeiou")
    assert score(task, reply) < letter_share(task, reply)
    assert variety(reply) < 0.5


# -- one default per knob: SAOOptions (and the trainer section) -----------------------------------------------------

def test_recipe_files_read_sao_defaults_instead_of_restating_them():
    from pathlib import Path

    import yaml

    defaults = {f.name: f.default for f in dataclasses.fields(SAOOptions)}
    conf = Path(__file__).resolve().parents[1] / "reef_sao" / "conf"
    for path in sorted(conf.glob("**/*.yaml")):
        options = ((yaml.safe_load(path.read_text()) or {}).get("recipe") or {}).get("options") or {}
        restated = {k: v for k, v in options.items() if k in defaults and v == defaults[k]}
        assert not restated, f"{path.name} restates SAOOptions defaults {restated}"


def test_composed_options_carry_the_dataclass_defaults(pm):
    options = compose_config(["+recipe=sao"], pm).recipe.options
    defaults = SAOOptions()
    for knob in ("advantage", "eps_clip", "critic_steps_per_actor", "num_critic_only_steps", "length_adaptive_lambda",
                 "lambda_alpha", "critic_lambda", "gamma", "save_critic"):
        assert options[knob] == getattr(defaults, knob), knob
    assert options["critic_lr"] == compose_config(["+recipe=sao"], pm).trainer.critic_lr  # the trainer section's


def test_objective_defaults_are_read_from_sao_options():
    """SAOObjective/GRPODISObjective default to SAOOptions' values (the same objects, not restated literals)."""
    import inspect

    fields = {f.name: f.default for f in dataclasses.fields(SAOOptions)}
    sao = inspect.signature(SAOObjective.__init__).parameters
    for knob in ("critic_steps_per_actor", "num_critic_only_steps", "length_adaptive_lambda", "lambda_alpha", "lam",
                 "critic_lambda", "gamma", "critic_max_grad_norm"):
        assert sao[knob].default is fields[knob], knob
    trainer_defaults = {f.name: f.default for f in dataclasses.fields(TrainerConfig)}
    assert sao["critic_lr"].default is trainer_defaults["critic_lr"]
    grpo = inspect.signature(GRPODISObjective.__init__).parameters
    assert grpo["group_size"].default is fields["group_size"] and grpo["normalize_std"].default is fields["normalize_std"]


def test_sao_trainer_reads_the_trainer_section_without_fallbacks(pm, tmp_path):
    tok = build_tiny_tokenizer()
    setup = TrainerSetup(data_dir=tmp_path, load_base_model=lambda: build_tiny_model(seed=0, tokenizer=tok))
    section = TrainerConfig(lr=3e-3, critic_lr=7e-3, grad_accumulation=2)
    sao = pm.create("trainer", "sao", scenario="s", recipe=RecipeConfig(options={"batch_size": 4, "eps_clip_high": 5.0}),
                    trainer=section, context=setup)
    assert (sao.lr, sao.objective.critic_lr, sao.grad_accumulation) == (3e-3, 7e-3, 2)
