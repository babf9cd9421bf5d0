"""Reef core: the plugin host of the Serve → Observe → Grow → Commit loop.

A plugin package imports one module, :mod:`reef_core.api`: the hook marker, the contracts it implements or
subclasses (``Processor``, ``Trainer``, ``Objective``, ``Evaluator``, ``SelectionPolicy``, ``Surface``, ``Engine``),
what its factories receive (the typed config sections, ``ServingPorts``, ``ScenarioView``), the errors it may raise
and the helpers it may call. The hooks are specified in :mod:`reef_core.hookspecs`. Every other module is internal
and may move between releases; a test keeps the packages under ``plugins/`` on ``reef_core.api``.

This module holds ``__version__``, ``hookimpl`` (also in the api) and ``get_plugin_manager()`` (the loaded plugins
and their components, for the host and its tests).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version as _dist_version
from typing import Callable, TypeVar, cast

import pluggy

from .hookspecs import PROJECT

try:
    __version__ = _dist_version("reef-core")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+source"

_F = TypeVar("_F", bound=Callable[..., object])

_hookimpl = pluggy.HookimplMarker(PROJECT)


def hookimpl(function: _F | None = None, **options) -> _F:
    """Mark a function as a Reef hook implementation (typed wrapper over pluggy's marker)."""
    if function is None:
        return cast(_F, _hookimpl(**options))
    return cast(_F, _hookimpl(function, **options))


def get_plugin_manager():
    from .plugins import get_plugin_manager as _get

    return _get()


__all__ = ["__version__", "hookimpl", "get_plugin_manager"]
