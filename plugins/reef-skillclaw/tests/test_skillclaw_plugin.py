"""reef-skillclaw registers through the hooks and its recipe composes."""

from reef_core.testing import PluginManager, available_recipes, compose_config


def test_skillclaw_plugin_loads_and_registers_searchpath():
    pm = PluginManager()
    assert "skillclaw" in pm.info, pm.failures
    assert "reef_config_searchpath" in pm.info["skillclaw"].hooks
    assert "pkg://reef_skillclaw.conf" in pm.config_searchpath()


def test_skillclaw_recipe_composes():
    pm = PluginManager()
    assert "skillclaw" in available_recipes(pm)
    cfg = compose_config(["+recipe=skillclaw"], pm)
    assert cfg.recipe.name == "skillclaw"
    assert cfg.recipe.description
    assert (cfg.recipe.processor, cfg.recipe.trainer, cfg.recipe.surface, cfg.recipe.report_schema) == (
        "per_report", "skillclaw", "skills", "skillclaw")
    assert cfg.recipe.processor_options == {"batch_size": 60, "require_score": False}
    assert cfg.evaluation.policy == "always"


def test_skillclaw_components_are_registered():
    pm = PluginManager()
    assert "skillclaw" in pm.components["trainer"] and "skillclaw" in pm.components["report_schema"]
    assert "skills" in pm.components["surface"]
