"""reef-ttt registers through the hooks and its recipe, mode and profiles compose into valid options."""

import pytest

from reef_core.testing import PluginManager, available_recipes, compose_config
from reef_ttt.options import TTTOptions, check_processor_options


def test_ttt_plugin_loads_and_registers_its_components():
    pm = PluginManager()
    assert "ttt" in pm.info, pm.failures
    assert "pkg://reef_ttt.conf" in pm.config_searchpath()
    components = pm.components
    assert "ttt" in components["trainer"] and "ttt" in components["report_schema"]
    assert {"ttt/plan", "ttt/archive"} <= set(components["scenario_route"])


@pytest.mark.parametrize("overrides, mode, task, grid", [
    ([], "discover", "reef_ttt.tasks.circle_packing:make_task", (8, 64)),
    (["+ttt_mode=guidance"], "guidance", "reef_ttt.tasks.circle_packing:make_task", (2, 4)),
    (["+ttt_profile=tiny"], "discover", "reef_ttt.tasks.vowels:make_task", (2, 8)),
    (["+ttt_profile=tiny_packing"], "guidance", "reef_ttt.tasks.circle_packing:make_task", (2, 4)),
])
def test_ttt_recipe_composes(overrides, mode, task, grid):
    pm = PluginManager()
    assert "ttt" in available_recipes(pm)
    cfg = compose_config(["+recipe=ttt", *overrides], pm)
    assert cfg.recipe.name == "ttt" and cfg.recipe.processor == "grid" and cfg.recipe.trainer == "ttt"
    opts = TTTOptions.from_options(cfg.recipe.options)
    check_processor_options(opts, cfg.recipe.processor, cfg.recipe.processor_options)
    assert (opts.mode, opts.task, (opts.groups_per_step, opts.rollouts_per_group)) == (mode, task, grid)
    if not overrides:  # the paper's defaults
        assert cfg.trainer.lora and cfg.trainer.lora_rank == 32 and cfg.trainer.lora_alpha == 32
        assert cfg.trainer.lr == 4e-5 and opts.kl_coef == 0.1 and opts.betas == (0.9, 0.95)
        assert opts.advantage == "entropic_adaptive_beta" and opts.archive_cap == 1000
