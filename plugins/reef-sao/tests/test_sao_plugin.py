"""reef-sao registers through the hooks and its recipe composes."""

from reef_core.config import available_recipes, compose_config
from reef_core.plugins import PluginManager


def test_sao_plugin_loads_and_registers_searchpath():
    pm = PluginManager()
    assert "sao" in pm.info, pm.failures
    assert "reef_config_searchpath" in pm.info["sao"].hooks
    assert "pkg://reef_sao.conf" in pm.config_searchpath()


def test_sao_recipe_composes():
    pm = PluginManager()
    assert "sao" in available_recipes(pm)
    cfg = compose_config(["+recipe=sao"], pm)
    assert cfg.recipe.name == "sao"
    assert cfg.recipe.description
