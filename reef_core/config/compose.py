"""Compose the deployment config from Hydra overrides (``+recipe=sao server.port=8900``).

Recipe packages contribute their config directories through the ``reef_config_searchpath``
hook, so ``+recipe=<name>`` finds a recipe however its package was installed. Composition ends
in plain objects (:func:`to_plain`): the rest of Reef reads a :class:`ReefConfig` dataclass tree
whose free-form option sections are ordinary dicts and lists, never an OmegaConf node.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Iterable

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..errors import ConfigError
from .schema import SECRET_KEYS, ReefConfig, register_schema

CONFIG_MODULE = "reef_core.conf"
CONFIG_NAME = "config"


def searchpath_override(plugin_manager) -> list[str]:
    paths = plugin_manager.config_searchpath()
    return [f"hydra.searchpath=[{','.join(paths)}]"] if paths else []


def compose_config(overrides: Iterable[str] = (), plugin_manager=None) -> ReefConfig:
    """Return the resolved, validated config as plain objects; raise ConfigError naming what is wrong."""
    from ..plugins import get_plugin_manager

    pm = plugin_manager or get_plugin_manager()
    register_schema()
    overrides = list(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            try:
                cfg = compose(config_name=CONFIG_NAME, overrides=overrides + searchpath_override(pm))
            except (MissingConfigException, ConfigCompositionException) as exc:
                raise _explain(exc, overrides, pm) from None
            return to_plain(cfg)
    except HydraException as exc:
        raise ConfigError(f"invalid configuration: {exc}") from None
    except OmegaConfBaseException as exc:
        raise ConfigError(_omegaconf_message(exc)) from None


def to_plain(cfg: DictConfig) -> ReefConfig:
    """The composed tree as a :class:`ReefConfig` of dataclasses, dicts and lists (interpolations and
    environment fills resolved); raise ConfigError naming a bad field."""
    check_known_keys(cfg)
    try:
        plain = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(_omegaconf_message(exc)) from None
    if not isinstance(plain, ReefConfig):  # composed without the schema: nothing downstream could trust it
        raise ConfigError("invalid configuration: the composed config is not typed by reef_schema")
    return plain


def check_known_keys(cfg: DictConfig) -> None:
    """Refuse a key no field of its typed section declares (``+server.prot=1``): Hydra's ``+`` adds it to the
    composed tree, and turning that into dataclasses would drop it without a word. Free-form sections (``dict``
    fields: a component's options) are left to the component that reads them (checked at start-up too)."""
    stack: list[tuple[Any, type, str]] = [(cfg, ReefConfig, "")]
    while stack:
        node, cls, where = stack.pop()
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key in node.keys() if isinstance(node, DictConfig) else ():
            name = f"{where}.{key}" if where else str(key)
            if key not in fields:
                if not where and key == "hydra":
                    continue
                raise ConfigError(f"unknown key {name}; known keys{' of ' + where if where else ''}: "
                                  f"{', '.join(sorted(fields))}", key=name)
            child = node._get_node(key)
            kind = _dataclass_of(fields[key].type)
            if kind is not None and isinstance(child, DictConfig):
                stack.append((child, kind, name))
            elif kind is not None and isinstance(child, ListConfig):  # routes: a list of typed entries
                stack.extend((item, kind, f"{name}[{i}]") for i, item in enumerate(child) if isinstance(item, DictConfig))


def _dataclass_of(annotation: Any) -> type | None:
    """The dataclass a field holds, itself or as the items of a list (``list[RouteConfig]``), else None."""
    import typing

    from . import schema

    if isinstance(annotation, str):  # postponed annotations: resolve in the schema module
        annotation = eval(annotation, vars(schema), dict(vars(typing)))  # noqa: S307 - our own annotations
    if dataclasses.is_dataclass(annotation):
        return annotation
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is list and args and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def available_recipes(plugin_manager=None) -> list[str]:
    """Names of the ``recipe`` config group across reef_core and every plugin's search path."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path

    from ..plugins import get_plugin_manager

    pm = plugin_manager or get_plugin_manager()
    search_path = create_config_search_path(f"pkg://{CONFIG_MODULE}")
    for path in pm.config_searchpath():
        search_path.append(provider="reef-plugin", path=path)
    return sorted(ConfigLoaderImpl(config_search_path=search_path).get_group_options("recipe"))


def recipe_descriptions(plugin_manager=None) -> dict[str, str]:
    """Recipe name → one-line description, read from each recipe's own config."""
    out: dict[str, str] = {}
    for name in available_recipes(plugin_manager):
        try:
            cfg = compose_config([f"+recipe={name}"], plugin_manager)
            out[name] = cfg.recipe.description.strip().splitlines()[0] if cfg.recipe.description.strip() else ""
        except ConfigError as exc:
            out[name] = f"(invalid config: {exc.message})"
    return out


def redacted(cfg: ReefConfig | dict[str, Any]) -> dict[str, Any]:
    """A dict copy of the config (or of a dict of config sections) with secret values replaced by ``***``."""
    data = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else copy.deepcopy(cfg)

    def scrub(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in SECRET_KEYS and value:
                    node[key] = ["***"] * len(value) if isinstance(value, list) else "***"
                else:
                    scrub(value)
        elif isinstance(node, list):
            for item in node:
                scrub(item)

    scrub(data)
    return data


def as_yaml(cfg: ReefConfig | dict[str, Any]) -> str:
    """YAML text of a config (or of :func:`redacted`'s dict), in the schema's key order."""
    data = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else cfg
    return OmegaConf.to_yaml(OmegaConf.create(data))


def _explain(exc: Exception, overrides: list[str], pm) -> ConfigError:
    text = str(exc)
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key == "recipe" and ("recipe" in text and value in text):
            names = available_recipes(pm)
            plain = not override.startswith(("+", "~"))  # recipe=sao: a key assignment, not the group's selection
            if plain and value in names:
                return ConfigError(f"recipe={value} sets a key; select the recipe with +recipe={value} (note the '+')",
                                   available=names)
            hint = "; select one with '+recipe=<name>' (note the '+')" if plain else ""
            return ConfigError(
                f"unknown recipe {value!r}; available recipes: {', '.join(names) or 'none installed'}{hint}",
                available=names,
            )
    if "Could not override 'recipe'" in text:
        return ConfigError("select a recipe with '+recipe=<name>' (note the '+')", available=available_recipes(pm))
    cause = exc.__cause__
    if isinstance(cause, OmegaConfBaseException):
        return ConfigError(_omegaconf_message(cause))
    return ConfigError(f"invalid configuration: {text}")


def _omegaconf_message(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None)
    msg = (getattr(exc, "msg", None) or str(exc)).splitlines()[0]
    if key:
        return f"invalid value for {key}: {msg}"
    return f"invalid configuration: {msg}"
