"""Error bodies in each endpoint's own dialect.

OpenAI routes answer ``{"error": {"message", "type", "code", "param"}}``, Anthropic routes
``{"type": "error", "error": {"type", "message"}}`` and Reef's own routes
``{"error": {"code", "message"}}``. The status code is always the honest one. A client error about
one field names it: in OpenAI's ``param``, and in every dialect's message (``"max_tokens: ..."``).
"""

from __future__ import annotations

import json
import uuid
from typing import Literal

Dialect = Literal["openai", "anthropic", "reef"]

_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
    429: "rate_limit_error", 500: "api_error", 502: "api_error", 503: "overloaded_error", 504: "api_error",
}
_OPENAI_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error",
}


def dialect_for_path(path: str) -> Dialect:
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/v1/"):
        return "openai"
    return "reef"


def _text(value: str | None) -> str | None:
    # A message or param may echo a client's string: a lone surrogate in it would fail the UTF-8 encoding of the
    # answer itself (a 500 in place of the 4xx). Sent as its escape instead.
    if value is None:
        return None
    value = str(value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


def error_body(dialect: Dialect, status: int, message: str, code: str | None = None,
               param: str | None = None) -> dict:
    message, param = _text(message), _text(param)
    if dialect == "anthropic":
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    if dialect == "openai":
        kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        return {"error": {"message": message, "type": kind, "code": code, "param": param}}
    return {"error": {"code": code or str(status), "message": message}}


def error_bytes(dialect: Dialect, status: int, message: str, code: str | None = None,
                param: str | None = None) -> bytes:
    return json.dumps(error_body(dialect, status, message, code, param)).encode()


def new_error_id() -> str:
    """Id of one unexpected failure: in the client's 500 body (or stream error event) and in the log line."""
    return f"err_{uuid.uuid4().hex[:16]}"
