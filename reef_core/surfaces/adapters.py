"""Harness adapters: how a harness tree installs for one agent CLI (``GET /reef/harness/install``).

An adapter is pure: ``render`` maps the release's files and the model binding to the files to install, touching no
disk and running no agent. The binding (where Reef is, which model) is added at install time and is never part of a
release; the token is never written anywhere: the wrapper reads ``REEF_TOKEN`` when it runs.

At run time the ``reef-<adapter>`` wrapper starts a local capture proxy and exports ``REEF_PROXY_URL`` (the proxy's
base URL), ``OPENAI_BASE_URL``, ``ANTHROPIC_BASE_URL``, ``REEF_HARNESS_DIR`` and the adapter's ``environment``, then
runs ``binary`` (or, for ``binary=None``, the command line it was given).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import Conflict


@dataclass(frozen=True)
class ModelBinding:
    """Where the installed agent reaches Reef: ``url`` as the client reached it, the ``scenario`` and ``model``."""

    url: str
    scenario: str
    model: str


class HarnessAdapter:
    """Base of harness adapters. ``name`` is set by registration; subclasses set ``binary`` and ``environment`` and
    extend :meth:`extra_files`."""

    binary: str | None = None
    environment: dict[str, str] = {}
    description = ""

    def extra_files(self, files: dict[str, str], binding: ModelBinding) -> dict[str, str]:
        """The agent's own files added beside the tree (config pointing it at Reef)."""
        return {}

    def render(self, files: dict[str, str], binding: ModelBinding) -> dict[str, str]:
        """The files to install: the tree plus :meth:`extra_files`; a tree file in the adapter's place is a
        :class:`Conflict` (the install would overwrite it)."""
        extra = self.extra_files(files, binding)
        clash = sorted(set(extra) & set(files))
        if clash:
            raise Conflict(f"the harness tree has {clash[0]!r}, which this adapter writes itself")
        return {**files, **extra}


def _env_line(name: str, value: str) -> str:
    return f"{name}='" + value.replace("'", "'\\''") + "'"


class GenericAdapter(HarnessAdapter):
    """Any agent: the tree as files, plus ``reef.env`` pointing an OpenAI- or Anthropic-compatible client straight
    at Reef (``set -a; . ./reef.env``). ``reef-generic <command...>`` runs a command through the capture proxy."""

    description = "the tree as files plus reef.env; reef-generic runs any command through the capture proxy"

    def extra_files(self, files, binding):
        lines = ["# Points an agent at Reef directly (source with `set -a; . ./reef.env`). Receipts are only",
                 "# captured for `reef-generic report` when the agent runs as `reef-generic <command>`.",
                 _env_line("REEF_URL", binding.url), _env_line("REEF_SCENARIO", binding.scenario),
                 _env_line("OPENAI_BASE_URL", binding.url + "/v1"), _env_line("ANTHROPIC_BASE_URL", binding.url),
                 _env_line("REEF_MODEL", binding.model)]
        return {"reef.env": "\n".join(lines) + "\n"}


class OpenCodeAdapter(HarnessAdapter):
    """OpenCode (``opencode-ai``): ``opencode.json`` with a ``reef`` provider (OpenAI-compatible, base URL and key
    read from the environment through OpenCode's ``{env:...}`` substitution) as the default model, and the tree's
    top-level Markdown files as ``instructions``. ``OPENCODE_CONFIG`` points OpenCode at it."""

    binary = "opencode"
    environment = {"OPENCODE_CONFIG": "{dir}/opencode.json"}
    description = "OpenCode: opencode.json (reef provider through the capture proxy) and the tree's instructions"

    def extra_files(self, files, binding):
        instructions = sorted(p for p in files if "/" not in p and p.endswith(".md"))
        config = {
            "$schema": "https://opencode.ai/config.json",
            "provider": {"reef": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Reef",
                "options": {"baseURL": "{env:REEF_PROXY_URL}/v1", "apiKey": "{env:REEF_AGENT_KEY}"},
                "models": {binding.model: {"name": binding.model}},
            }},
            "model": f"reef/{binding.model}",
            "instructions": [f"{{env:REEF_HARNESS_DIR}}/{p}" for p in instructions],
        }
        return {"opencode.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n"}
