"""Reef's Python client (no torch): capture receipts under the OpenAI and Anthropic SDKs, report on them, read
records, releases and status, and pull harness trees.

    from reef_core.client import ReefClient

    reef = ReefClient("http://127.0.0.1:8000", scenario="math", tags={"session": "s1"})
    chat = reef.openai()                       # an openai.OpenAI whose calls carry the scenario and tags
    chat.chat.completions.create(model="m", messages=[...], stream=True)
    reef.report(score=1.0, feedback="right", references="last")

Receipts come from the ``x-reef-agent-record-id`` header or, for streams, from the in-band ``reef`` field; each
lands in ``reef.receipts``. ``reef.import_records(lines)`` imports logged exchanges and reports without calling a
model (``POST /reef/records/batch``).

Needs ``reef-core[client]`` (httpx; the SDKs for ``openai()`` / ``anthropic()``). Names load on first use, so
the server can use :mod:`reef_core.client.tree` (the sidecar format it bakes into install scripts) without httpx.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "Receipt": "capture", "ReceiptLog": "capture",
    "AsyncReefClient": "core", "ReefClient": "core",
    **{name: "errors" for name in ("BadRequest", "Conflict", "Forbidden", "NotFound", "RateLimited", "ReefClientError",
                                   "ServerError", "Unauthorized", "Unreachable")},
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'reef_core.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
