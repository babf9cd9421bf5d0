"""Hook implementations of reef-openclaw, loaded through the ``reef`` entry point."""

from __future__ import annotations

from reef_core.api import hookimpl


@hookimpl
def reef_config_searchpath():
    return "pkg://reef_openclaw.conf"
