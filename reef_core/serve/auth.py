"""Bearer-token authentication with two scopes: inference and admin.

* ``GET /healthz`` and the dashboard's login page are open without a token (and ``GET /metrics`` with
  ``server.metrics_public=true``).
* Dashboard pages (``/ui...``) also take the token from the ``reef_ui_token`` cookie its login form sets; a
  browser without a valid one is sent to ``/ui/login``.
* ``Authorization: Bearer <token>`` (scheme case-insensitive); when absent, ``x-api-key``
  (what Anthropic SDKs send) is accepted.
* Tokens are compared as SHA-256 digests with ``hmac.compare_digest`` against every configured
  token (no early exit), and never logged.
* Admin tokens may call everything; inference tokens get 403 on routes marked admin (rollback,
  promote, delete).
* With no token configured at all, authentication is off; ``reef serve`` refuses to bind a
  non-loopback address in that state.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
from urllib.parse import unquote
from dataclasses import dataclass

from .errors import dialect_for_path, error_bytes

OPEN_PATHS = frozenset({"/healthz", "/ui/login"})
#: The dashboard's cookie: the token its login form stored, read for ``/ui`` paths only.
UI_COOKIE = "reef_ui_token"


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True)
class TokenSet:
    inference: tuple[bytes, ...]
    admin: tuple[bytes, ...]

    @classmethod
    def from_config(cls, server_cfg) -> "TokenSet":
        inference = [t for t in list(server_cfg.tokens) + [os.environ.get("REEF_TOKEN", "")] if t]
        admin = [t for t in list(server_cfg.admin_tokens) + [os.environ.get("REEF_ADMIN_TOKEN", "")] if t]
        # Empty strings are dropped so an unset variable never becomes a credential.
        return cls(tuple(_digest(t) for t in dict.fromkeys(inference)),
                   tuple(_digest(t) for t in dict.fromkeys(admin)))

    @property
    def enabled(self) -> bool:
        return bool(self.inference or self.admin)

    def scope_of(self, token: str) -> str | None:
        digest = _digest(token)
        is_admin = False
        is_inference = False
        for known in self.admin:
            is_admin |= hmac.compare_digest(digest, known)
        for known in self.inference:
            is_inference |= hmac.compare_digest(digest, known)
        return "admin" if is_admin else "inference" if is_inference else None


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _presented_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    authorization = api_key = None
    for name, value in headers:
        if name == b"authorization":
            authorization = value.decode("latin-1")
        elif name == b"x-api-key":
            api_key = value.decode("latin-1")
    if authorization is not None:
        scheme, _, token = authorization.strip().partition(" ")
        return token.strip() if scheme.lower() == "bearer" and token.strip() else ""
    return api_key


class AuthMiddleware:
    """Pure ASGI middleware: checks the token before any routing or body parsing."""

    def __init__(self, app, tokens: TokenSet, admin_routes: list[tuple[re.Pattern, frozenset[str]]],
                 open_paths: frozenset[str] = OPEN_PATHS):
        self.app = app
        self.open_paths = open_paths
        self.tokens = tokens
        self.admin_routes = admin_routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths or not self.tokens.enabled:
            if scope["type"] == "http":
                scope.setdefault("state", {})["reef_scope"] = "admin"
            return await self.app(scope, receive, send)
        dashboard = scope["path"] == "/ui" or scope["path"].startswith("/ui/")
        token = _presented_token(scope["headers"])
        if token is None and dashboard:
            token = _cookie_token(scope["headers"])
        granted = self.tokens.scope_of(token) if token else None
        if granted is None:
            if dashboard and scope["method"] in ("GET", "HEAD"):
                return await _redirect(send, "/ui/login")
            return await _deny(send, scope["path"], 401, "invalid service token")
        if granted != "admin" and self._is_admin_route(scope["method"], scope["path"]):
            return await _deny(send, scope["path"], 403, "this route needs an admin token")
        scope.setdefault("state", {})["reef_scope"] = granted
        return await self.app(scope, receive, send)

    def _is_admin_route(self, method: str, path: str) -> bool:
        return any(methods and method in methods and regex.match(path) for regex, methods in self.admin_routes)


async def _deny(send, path: str, status: int, message: str) -> None:
    body = error_bytes(dialect_for_path(path), status, message, "unauthorized" if status == 401 else "forbidden")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _cookie_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"cookie":
            for part in value.decode("latin-1").split(";"):
                key, _, found = part.strip().partition("=")
                if key == UI_COOKIE and found:
                    return unquote(found)  # the login form stores it percent-encoded
    return None


async def _redirect(send, location: str) -> None:
    await send({"type": "http.response.start", "status": 303,
                "headers": [(b"location", location.encode()), (b"content-length", b"0"),
                            (b"cache-control", b"no-store")]})
    await send({"type": "http.response.body", "body": b""})
