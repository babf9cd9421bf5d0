"""reef-gepa registers through the hooks and its recipe composes."""

from reef_core.config import available_recipes, compose_config
from reef_core.plugins import PluginManager


def test_gepa_plugin_loads_and_registers_searchpath():
    pm = PluginManager()
    assert "gepa" in pm.info, pm.failures
    assert "reef_config_searchpath" in pm.info["gepa"].hooks
    assert "pkg://reef_gepa.conf" in pm.config_searchpath()


def test_gepa_recipe_composes():
    pm = PluginManager()
    assert "gepa" in available_recipes(pm)
    cfg = compose_config(["+recipe=gepa"], pm)
    assert cfg.recipe.name == "gepa"
    assert cfg.recipe.description
