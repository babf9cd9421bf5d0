"""reef-openclaw registers through the hooks and its recipe composes."""

from reef_core.testing import PluginManager, available_recipes, compose_config


def test_openclaw_plugin_loads_and_registers_searchpath():
    pm = PluginManager()
    assert "openclaw" in pm.info, pm.failures
    assert "reef_config_searchpath" in pm.info["openclaw"].hooks
    assert "pkg://reef_openclaw.conf" in pm.config_searchpath()


def test_openclaw_recipe_composes():
    pm = PluginManager()
    assert "openclaw" in available_recipes(pm)
    cfg = compose_config(["+recipe=openclaw"], pm)
    assert cfg.recipe.name == "openclaw"
    assert cfg.recipe.description
