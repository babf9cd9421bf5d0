"""Load an object named by a dotted path (``"package.module:attribute"``) from config."""

from __future__ import annotations

import importlib
from typing import Any

from .errors import ConfigError


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
