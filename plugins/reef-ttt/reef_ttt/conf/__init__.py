"""Hydra config group files of reef-ttt (found through ``reef_config_searchpath``)."""
