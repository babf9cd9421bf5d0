"""Reef core: the plugin host of the Serve → Observe → Grow → Commit loop.

Public API for plugin packages:

* ``hookimpl``: decorate hook implementations (see ``reef_core.hookspecs`` for every hook);
* ``reef_core.errors``: the exceptions a plugin may raise;
* ``get_plugin_manager()``: the loaded plugins and their components.
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
