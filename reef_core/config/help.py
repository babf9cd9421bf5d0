"""What ``reef serve --help`` adds to its usage: the config sections with their most-used keys and defaults, and
the config groups a command line selects (``+recipe=sao``, ``+sao_profile=tiny``).

Generated, not written by hand: the sections and their key counts come from the schema
(:class:`~reef_core.config.schema.ReefConfig`), the defaults from the composed default config (what ``reef serve``
with no override runs), and the groups and their options from the config search path of every installed recipe
package. :data:`COMMON_KEYS` only chooses which keys are shown per section; a test holds each of them to the
schema.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

#: The keys shown per section (every other key is counted; ``reef config`` prints them all).
COMMON_KEYS: dict[str, tuple[str, ...]] = {
    "server": ("host", "port", "tokens", "admin_tokens", "workers", "log_level", "log_format",
               "allow_implicit_scenarios"),
    "storage": ("data_dir", "records_url", "artifact_store"),
    "engine": ("kind", "model", "upstream_url", "upstream_model", "max_new_tokens", "temperature", "device",
               "model_cache_dir"),
    "trainer": ("backend", "device", "lr", "lora"),
    "evaluation": ("evaluator", "policy"),
    "recipe": ("name", "processor", "trainer", "surface"),
    "learn": ("file", "rollouts", "max_tokens"),
}

_WIDTH = 100


def _value(value: Any) -> str:
    """A default as it is written on the command line (``null``, ``true``, ``[]``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _wrapped(label: str, items: list[str], indent: int = 14) -> list[str]:
    """``label`` then ``items`` separated by two spaces, wrapped under the first item."""
    lines, line = [], f"  {(label + ' ').ljust(indent - 2)}"  # a label as wide as the indent still gets a blank
    for item in items:
        if line.strip() and len(line) + len(item) + 2 > _WIDTH and len(line) > indent:
            lines.append(line.rstrip())
            line = " " * indent
        line += item + "  "
    lines.append(line.rstrip())
    return lines


def section_lines(cfg) -> list[str]:
    """One entry per section of the schema: its most-used keys with their defaults in ``cfg``, and how many
    keys it has besides; then the top-level keys."""
    lines = []
    scalars = []
    for field in dataclasses.fields(cfg):
        section = getattr(cfg, field.name)
        if not dataclasses.is_dataclass(section):
            if not isinstance(section, (list, dict)):
                scalars.append(f"{field.name}={_value(section)}")
            continue
        if len(dataclasses.fields(section)) == 1 and dataclasses.is_dataclass(getattr(section, dataclasses.fields(
                section)[0].name)):  # a section of one subsection (observability.tracing): show the subsection's keys
            inner = dataclasses.fields(section)[0].name
            section, prefix = getattr(section, inner), f"{inner}."
        else:
            prefix = ""
        names = [f.name for f in dataclasses.fields(section)]
        shown = [name for name in COMMON_KEYS.get(field.name, ()) if name in names] or names[:4]
        items = [f"{prefix}{name}={_value(getattr(section, name))}" for name in shown]
        rest = len(names) - len(shown)
        if rest:
            items.append(f"(+{rest} more)")
        lines += _wrapped(field.name, items)
    if scalars:
        lines += _wrapped("(top level)", scalars)
    return lines


def group_lines(plugin_manager=None) -> list[str]:
    """Each config group of the search path (Hydra's own left out) with its options; a group named after a recipe
    (``sao_profile``) says which recipe it goes with."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path

    from ..plugins import get_plugin_manager
    from .compose import CONFIG_MODULE

    pm = plugin_manager or get_plugin_manager()
    search_path = create_config_search_path(f"pkg://{CONFIG_MODULE}")
    for path in pm.config_searchpath():
        search_path.append(provider="reef-plugin", path=path)
    loader = ConfigLoaderImpl(config_search_path=search_path)
    groups = sorted(group for group in loader.list_groups("") if group != "hydra")
    recipes = set(loader.get_group_options("recipe")) if "recipe" in groups else set()
    lines = []
    indent = max((len(group) for group in groups), default=0) + 6  # "  +" GROUP "=" and a space
    for group in sorted(groups, key=lambda g: (g != "recipe", g)):
        options = sorted(loader.get_group_options(group))
        owner = next((r for r in sorted(recipes, key=len, reverse=True) if group.startswith(f"{r}_")), None)
        note = "(reef recipes describes them)" if group == "recipe" else (
            f"(after +recipe={owner})" if owner else "")
        lines += _wrapped(f"+{group}=", [", ".join(options)] + ([note] if note else []), indent)
    return lines


def serve_epilog(plugin_manager=None) -> str:
    """The text ``reef serve --help`` prints after its usage."""
    from .compose import compose_config

    cfg = compose_config([], plugin_manager)
    return "\n".join([
        "config sections: override any key as SECTION.KEY=VALUE (e.g. server.port=9000); the most-used keys with",
        "their defaults (a recipe changes some: `reef config +recipe=NAME` prints every key as it resolves):",
        *section_lines(cfg),
        "",
        "config groups: select one option of a group with +GROUP=OPTION (a recipe first, then its profile):",
        *group_lines(plugin_manager),
        "",
        "examples:",
        "  reef serve +recipe=NAME server.port=9000",
        "  reef serve engine.kind=upstream engine.upstream_url=http://127.0.0.1:8000/v1 engine.upstream_model=M",
    ])
