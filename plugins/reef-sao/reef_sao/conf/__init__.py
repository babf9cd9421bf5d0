"""Hydra config group files of reef-sao (found through ``reef_config_searchpath``)."""
