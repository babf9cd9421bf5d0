"""Typed errors of the Reef client: each carries the HTTP status and the server's own message."""

from __future__ import annotations


class ReefClientError(Exception):
    """A Reef route refused a request (or could not be reached). ``status`` is the HTTP status (0 when no
    answer came), ``message`` the server's message, ``code`` and ``param`` its error code and the field it names."""

    def __init__(self, message: str, *, status: int = 0, code: str | None = None, param: str | None = None):
        super().__init__(message if not status else f"{status}: {message}")
        self.message = message
        self.status = status
        self.code = code
        self.param = param


class BadRequest(ReefClientError):
    """400: the server refused the request's content (a schema or reference error); never retried."""


class Unauthorized(ReefClientError):
    """401 or 403: the token is missing, wrong, or lacks the scope the route needs."""


class Forbidden(Unauthorized):
    """403: the token lacks the scope the route needs, or is confined to other scenarios (``server.scoped_tokens``)."""


class NotFound(ReefClientError):
    """404: an unknown scenario, record or release."""


class Conflict(ReefClientError):
    """409: a client id reused with other content, or a processor's door rule (one report per slot)."""


class RateLimited(ReefClientError):
    """429 after every retry, or at once when the server asks for a long wait (a spent token budget):
    ``retry_after`` is its ``Retry-After`` in seconds (None when it gave none: a ``total`` budget is spent)."""

    retry_after: float | None = None


class ServerError(ReefClientError):
    """5xx after every retry."""


class Unreachable(ReefClientError):
    """No answer: the connection failed or timed out after every retry."""


_BY_STATUS = {400: BadRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound, 409: Conflict, 429: RateLimited}


def error_for(status: int, body: object, fallback: str) -> ReefClientError:
    """The typed error of a refused answer: ``body`` is its parsed JSON (Reef's OpenAI- or Anthropic-shaped error
    body) or None, ``fallback`` the text to show when the body names no message."""
    message, code, param = fallback, None, None
    if isinstance(body, dict):
        inner = body.get("error") if isinstance(body.get("error"), dict) else body
        message = str(inner.get("message") or body.get("detail") or fallback)
        code = inner.get("code") or inner.get("type")
        param = inner.get("param")
    kind = _BY_STATUS.get(status, ServerError if status >= 500 else ReefClientError)
    return kind(message, status=status, code=code, param=param)
