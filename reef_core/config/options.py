"""A component's options section read into a dataclass's fields: one rule for every recipe and judge.

Options come from Hydra as plain mappings whose keys may be snake_case or kebab-case (the reference configs use
kebab-case); a key that names no field is a :class:`~reef_core.errors.ConfigError` naming it, where it was, and the
known ones, so a typo never silently falls back to a default.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import fields
from typing import Any

from ..errors import ConfigError


def option_values(cls: type, options: Any, *, who: str, section: str = "recipe.options",
                  aliases: Mapping[str, str] | None = None, ignore: Collection[str] = ()) -> dict[str, Any]:
    """``options`` (a mapping or None) as keyword arguments of the dataclass ``cls``.

    ``who`` prefixes errors (``"sao"``, ``"judge 'prm'"``); ``aliases`` renames keys that cannot be field names
    (``lambda``); keys in ``ignore`` belong to another reader of the same section and are skipped."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"{who}: {section} must be a mapping, got {type(options).__name__}")
    known = {f.name for f in fields(cls)}
    values: dict[str, Any] = {}
    for key, value in options.items():
        name = str(key).replace("-", "_")
        name = (aliases or {}).get(name, name)
        if name in ignore:
            continue
        if name not in known:
            names = ", ".join(sorted(known | set(ignore)))
            raise ConfigError(f"{who}: unknown option {key!r} in {section} (known: {names})")
        values[name] = value
    return values
