"""Hydra config group files of reef-gepa (found through ``reef_config_searchpath``)."""
