"""reef-ttt registers through the hooks and its recipe composes."""

from reef_core.testing import PluginManager, available_recipes, compose_config


def test_ttt_plugin_loads_and_registers_searchpath():
    pm = PluginManager()
    assert "ttt" in pm.info, pm.failures
    assert "reef_config_searchpath" in pm.info["ttt"].hooks
    assert "pkg://reef_ttt.conf" in pm.config_searchpath()


def test_ttt_recipe_composes():
    pm = PluginManager()
    assert "ttt" in available_recipes(pm)
    cfg = compose_config(["+recipe=ttt"], pm)
    assert cfg.recipe.name == "ttt"
    assert cfg.recipe.description
