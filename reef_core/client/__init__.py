"""Reef's Python client (no torch): capture receipts under the OpenAI and Anthropic SDKs, report on them, read
records, releases and status, and pull harness trees.

    from reef_core.client import ReefClient

    reef = ReefClient("http://127.0.0.1:8000", scenario="math", tags={"session": "s1"})
    chat = reef.openai()                       # an openai.OpenAI whose calls carry the scenario and tags
    chat.chat.completions.create(model="m", messages=[...], stream=True)
    reef.report(score=1.0, feedback="right", references="last")

Receipts come from the ``x-reef-agent-record-id`` header or, for streams, from the in-band ``reef`` field; each
lands in ``reef.receipts``. Record import is not offered: the server has no import route.
"""

from .capture import Receipt, ReceiptLog
from .core import AsyncReefClient, ReefClient
from .errors import (BadRequest, Conflict, NotFound, RateLimited, ReefClientError, ServerError, Unauthorized,
                     Unreachable)

__all__ = ["AsyncReefClient", "BadRequest", "Conflict", "NotFound", "RateLimited", "Receipt", "ReceiptLog",
           "ReefClient", "ReefClientError", "ServerError", "Unauthorized", "Unreachable"]
