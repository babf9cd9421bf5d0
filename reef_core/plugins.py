"""Plugin loading and the component registry, and the loader of dotted paths (``"package.module:name"``)
that config may name instead of a registered component.

Loading order: Reef's built-in plugins (``DEFAULT_PLUGINS``), then installed ``reef`` entry
points one by one. A plugin that fails to import or to register is recorded in ``failures``
and shown by ``reef plugins``; it never stops Reef. Environment variables:

``REEF_LOAD_PLUGINS``    comma-separated entry-point names: load only these (allow-list);
                          an empty value loads no entry-point plugins at all.
``REEF_DISABLE_PLUGINS`` comma-separated entry-point names never to load (block-list).
``REEF_TRACE_PLUGINS``   set to 1 to log every hook call.

After loading, ``check_pending()`` makes a misspelled hook implementation fail loudly.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import threading
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import pluggy

from . import hookspecs
from .errors import ComponentConflict, ConfigError, PluginError, UnknownComponent

log = logging.getLogger("reef.plugins")

ENTRY_POINT_GROUP = "reef"

DEFAULT_PLUGINS: tuple[str, ...] = (
    "reef_core.builtins.engines",
    "reef_core.builtins.storage",
    "reef_core.builtins.processors",
    "reef_core.builtins.gate",
    "reef_core.builtins.tasks",
    "reef_core.builtins.weights",
    "reef_core.builtins.trainers",
    "reef_core.builtins.surfaces",
)

#: Component kinds and the hook that registers each.
COMPONENT_HOOKS: dict[str, str] = {
    "processor": "reef_register_processors",
    "judge": "reef_register_judges",
    "trainer": "reef_register_trainers",
    "evaluator": "reef_register_evaluators",
    "selection_policy": "reef_register_selection_policies",
    "artifact_store": "reef_register_artifact_stores",
    "surface": "reef_register_surfaces",
    "engine": "reef_register_engines",
    "report_schema": "reef_register_report_schemas",
    "task": "reef_register_tasks",
    "scenario_route": "reef_register_scenario_routes",
    "harness_adapter": "reef_register_harness_adapters",
}


@dataclass(frozen=True)
class Component:
    kind: str
    name: str
    factory: Callable[..., Any]
    plugin: str
    description: str = ""
    #: module -> the pip requirement installing it (e.g. ``{"dspy": "reef-gepa[dspy]"}``): checked at start-up
    #: for the components a config names, so a missing optional dependency is a config error, not a late ImportError.
    requires: Mapping[str, str] = field(default_factory=dict)
    #: ``check_options(recipe=<RecipeConfig>)``: raises :class:`~reef_core.errors.ConfigError` for an option the
    #: component would refuse (an unknown key above all). Called at start-up for the components a config names,
    #: since most are built only on first use, when a typo would quietly fail every step instead.
    check_options: Callable[..., Any] | None = None


@dataclass
class PluginInfo:
    name: str
    module: str
    version: str | None
    builtin: bool
    hooks: list[str] = field(default_factory=list)


class PluginManager:
    """A pluggy manager plus the component registry built from the registration hooks."""

    def __init__(self, *, load_entry_points: bool = True, extra_plugins: tuple[Any, ...] = ()):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.failures: dict[str, str] = {}
        self.info: dict[str, PluginInfo] = {}
        self._components: dict[str, dict[str, Component]] | None = None
        # (hook, plugin) -> a pluggy caller of that plugin's implementation alone
        self._single_callers: dict[tuple[str, str], Any] = {}
        for module_name in DEFAULT_PLUGINS:
            self._register_module(module_name, module_name, version=None, builtin=True)
        for plugin in extra_plugins:
            self._register(plugin, getattr(plugin, "__name__", repr(plugin)), None, builtin=False)
        if load_entry_points:
            self._load_entry_points()
        self.pm.check_pending()
        if os.environ.get("REEF_TRACE_PLUGINS"):
            self.pm.trace.root.setwriter(log.info)
            self.pm.enable_tracing()

    @property
    def hook(self):
        return self.pm.hook

    # -- loading ---------------------------------------------------------------------------

    def _load_entry_points(self) -> None:
        allow = _env_list("REEF_LOAD_PLUGINS")
        block = set(_env_list("REEF_DISABLE_PLUGINS") or ())
        for name in block:
            self.pm.set_blocked(name)
        seen: dict[str, str] = {}
        for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = ep.dist.name if ep.dist else "?"
            if allow is not None and ep.name not in allow:
                continue
            if ep.name in block:
                continue
            if ep.name in seen and seen[ep.name] != dist:
                # pluggy would silently keep the first one; a user must hear about it.
                self.failures[ep.name] = (
                    f"entry point name {ep.name!r} is claimed by both {seen[ep.name]!r} and {dist!r}"
                )
                continue
            seen[ep.name] = dist
            version = ep.dist.version if ep.dist else None
            try:
                plugin = ep.load()
            except Exception:  # noqa: BLE001 - a broken plugin must not stop Reef
                self.failures[ep.name] = traceback.format_exc(limit=3).strip()
                log.warning("plugin %s failed to load:\n%s", ep.name, self.failures[ep.name])
                continue
            self._register(plugin, ep.name, version, builtin=False)

    def _register_module(self, module_name: str, name: str, version: str | None, builtin: bool) -> None:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001
            self.failures[name] = traceback.format_exc(limit=3).strip()
            return
        self._register(module, name, version, builtin)

    def _register(self, plugin: Any, name: str, version: str | None, builtin: bool) -> None:
        try:
            self.pm.register(plugin, name=name)
        except (ValueError, pluggy.PluginValidationError) as exc:
            self.failures[name] = f"{type(exc).__name__}: {exc}"
            return
        hooks = sorted(h.name for h in self.pm.get_hookcallers(plugin) or ())
        module = getattr(plugin, "__name__", type(plugin).__name__)
        self.info[name] = PluginInfo(name=name, module=module, version=version, builtin=builtin, hooks=hooks)

    # -- components ------------------------------------------------------------------------

    @property
    def components(self) -> dict[str, dict[str, Component]]:
        if self._components is None:
            self._components = self._collect_components()
        return self._components

    def _collect_components(self) -> dict[str, dict[str, Component]]:
        found: dict[str, dict[str, Component]] = {kind: {} for kind in COMPONENT_HOOKS}
        for kind, hook_name in COMPONENT_HOOKS.items():
            caller = getattr(self.pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                plugin_name = impl.plugin_name

                def register(name: str, factory: Callable[..., Any], *, description: str = "",
                             requires: Mapping[str, str] | None = None,
                             check_options: Callable[..., Any] | None = None, _kind=kind,
                             _plugin=plugin_name) -> None:
                    if not isinstance(name, str) or not name:
                        raise PluginError(f"plugin {_plugin!r} registered a {_kind} with an invalid name {name!r}")
                    previous = found[_kind].get(name)
                    if previous is not None:
                        raise ComponentConflict(
                            f"{_kind} {name!r} is registered by both plugin {previous.plugin!r} and plugin "
                            f"{_plugin!r}; uninstall or disable one (REEF_DISABLE_PLUGINS={_plugin})"
                        )
                    found[_kind][name] = Component(_kind, name, factory, _plugin, description, dict(requires or {}),
                                                   check_options)

                try:
                    self._call_one(hook_name, impl, register=register)
                except ComponentConflict:
                    raise
                except Exception:  # noqa: BLE001 - record the plugin as failed, keep the rest
                    self.failures[plugin_name] = traceback.format_exc(limit=3).strip()
                    log.warning("plugin %s failed in %s:\n%s", plugin_name, hook_name, self.failures[plugin_name])
        return found

    def get(self, kind: str, name: str) -> Component:
        try:
            return self.components[kind][name]
        except KeyError:
            available = ", ".join(sorted(self.components.get(kind, {}))) or "none"
            raise UnknownComponent(f"no {kind.replace('_', ' ')} named {name!r}; available: {available}") from None

    def create(self, kind: str, name: str, /, **kwargs) -> Any:
        """Build the component ``name`` of ``kind`` with its factory's keyword arguments.

        A name with a colon (``"package.module:Name"``) is an explicit dotted path instead of a registered
        name: the object it names is called like a registered factory (a class is instantiated), or used
        as is when it is not callable. Every kind takes such paths through this one loader."""
        if ":" in name:
            target = load_object(name)
            return target(**kwargs) if callable(target) else target
        return self.get(kind, name).factory(**kwargs)

    def config_searchpath(self) -> list[str]:
        paths: list[str] = []
        for result in self.pm.hook.reef_config_searchpath():
            for entry in [result] if isinstance(result, str) else list(result or ()):
                if entry not in paths:
                    paths.append(entry)
        return paths

    def notify(self, hook_name: str, **kwargs) -> None:
        """Call a lifecycle hook; one failing plugin is logged, never propagated."""
        caller = getattr(self.pm.hook, hook_name)
        for impl in reversed(caller.get_hookimpls()):
            try:
                self._call_one(hook_name, impl, **kwargs)
            except Exception:  # noqa: BLE001
                log.exception("plugin %s failed in %s", impl.plugin_name, hook_name)

    def _call_one(self, hook_name: str, impl, **kwargs) -> Any:
        """Call one plugin's implementation of a hook through pluggy (so tracing and pluggy's argument
        matching apply), keeping each plugin's failure its own."""
        key = (hook_name, impl.plugin_name)
        caller = self._single_callers.get(key)
        if caller is None:
            others = [p for p in self.pm.get_plugins() if p is not impl.plugin]
            caller = self._single_callers[key] = self.pm.subset_hook_caller(hook_name, remove_plugins=others)
        return caller(**kwargs)


def _env_list(var: str) -> list[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return [part.strip() for part in raw.split(",") if part.strip()]


_lock = threading.Lock()
_manager: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, loaded on first use."""
    global _manager
    with _lock:
        if _manager is None:
            _manager = PluginManager()
        return _manager


def reset_plugin_manager() -> None:
    """Forget the loaded plugins (tests; a reload after installing a package)."""
    global _manager
    with _lock:
        _manager = None

def load_object(path: str) -> Any:
    """Import ``"pkg.mod:attr"`` (or ``"pkg.mod.attr"``); a clear ConfigError when it cannot."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ConfigError(f"expected a dotted path 'pkg.module:name', got {path!r}")
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module!r} for {path!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{module!r} has no attribute {attr!r}") from None
    return obj


def load_callable(path: str, what: str) -> Any:
    """:func:`load_object`, refusing anything that cannot be called."""
    target = load_object(path)
    if not callable(target):
        raise ConfigError(f"{what} {path!r} is not callable")
    return target
