"""Hydra config group files of reef-openclaw (found through ``reef_config_searchpath``)."""
