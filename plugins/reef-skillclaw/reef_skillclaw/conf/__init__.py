"""Hydra config group files of reef-skillclaw (found through ``reef_config_searchpath``)."""
