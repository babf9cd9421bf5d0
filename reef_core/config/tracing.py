"""``observability.tracing``: its values checked when the config is built, its environment at start-up.

Values (``protocol``, ``sample``, the queue bounds...) are refused as the config composes, naming the key. What
depends on the machine, the ``headers``' environment variables and the ``otel`` extra, is checked by
:func:`check_tracing_start`, which ``reef serve`` runs before it writes or loads anything.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any
from urllib.parse import urlsplit

from ..errors import ConfigError

KEY = "observability.tracing"
PROTOCOLS = ("http/protobuf", "grpc")
#: Where a collector listens when ``endpoint`` is unset (the OTLP defaults, on loopback).
DEFAULT_ENDPOINTS = {"http/protobuf": "http://127.0.0.1:4318/v1/traces", "grpc": "http://127.0.0.1:4317"}
# gRPC metadata keys are lower-case HTTP tokens; the same rule suits both protocols.
_HEADER_NAME = re.compile(r"^[a-z0-9!#$%&'*+.^_`|~-]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_tracing(cfg: Any) -> None:
    """Refuse a value of ``observability.tracing`` that no exporter could use, naming its key."""
    _check_bool(cfg, "enabled")
    _check_bool(cfg, "include_content")
    if cfg.protocol not in PROTOCOLS:
        raise ConfigError(f"{KEY}.protocol must be one of {', '.join(PROTOCOLS)}, not {cfg.protocol!r}",
                          key=f"{KEY}.protocol")
    if cfg.endpoint is not None:
        endpoint_url(cfg)
    if not isinstance(cfg.service_name, str) or not cfg.service_name.strip() or len(cfg.service_name) > 255:
        raise ConfigError(f"{KEY}.service_name must be a non-empty name of at most 255 characters",
                          key=f"{KEY}.service_name")
    if not _number(cfg.sample) or not 0.0 <= cfg.sample <= 1.0:
        raise ConfigError(f"{KEY}.sample must be a ratio between 0 and 1, not {cfg.sample!r}", key=f"{KEY}.sample")
    for name, low, high in (("max_queue_size", 1, 1_000_000), ("max_export_batch_size", 1, 100_000)):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ConfigError(f"{KEY}.{name} must be an integer from {low} to {high}, not {value!r}",
                              key=f"{KEY}.{name}")
    if cfg.max_export_batch_size > cfg.max_queue_size:
        raise ConfigError(f"{KEY}.max_export_batch_size ({cfg.max_export_batch_size}) must not exceed "
                          f"{KEY}.max_queue_size ({cfg.max_queue_size})", key=f"{KEY}.max_export_batch_size")
    for name in ("schedule_delay_s", "export_timeout_s"):
        value = getattr(cfg, name)
        if not _number(value) or not 0 < value <= 600:
            raise ConfigError(f"{KEY}.{name} must be a number of seconds above 0 and at most 600, not {value!r}",
                              key=f"{KEY}.{name}")
    if not isinstance(cfg.headers, dict):
        raise ConfigError(f"{KEY}.headers must map header names to environment variable names", key=f"{KEY}.headers")
    for name, var in cfg.headers.items():
        if not isinstance(name, str) or not _HEADER_NAME.match(name):
            raise ConfigError(f"{KEY}.headers: {name!r} is not a lower-case header name", key=f"{KEY}.headers")
        if not isinstance(var, str) or not _ENV_NAME.match(var):
            raise ConfigError(f"{KEY}.headers.{name} must name an environment variable (letters, digits, _), "
                              f"not {var!r}", key=f"{KEY}.headers.{name}")


def endpoint_url(cfg: Any) -> str:
    """The collector URL the exporter posts to: ``endpoint`` (http/protobuf: ``/v1/traces`` added to a URL without a
    path), else the protocol's loopback default."""
    if cfg.endpoint is None:
        return DEFAULT_ENDPOINTS[cfg.protocol]
    try:
        parts = urlsplit(cfg.endpoint) if isinstance(cfg.endpoint, str) else None
        if parts is not None:
            parts.port  # noqa: B018 - reading it raises ValueError for a port out of range or not a number
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{KEY}.endpoint must be an http:// or https:// URL with a host, not {cfg.endpoint!r}",
                          key=f"{KEY}.endpoint")
    if cfg.protocol == "http/protobuf" and parts.path in ("", "/"):
        return cfg.endpoint.rstrip("/") + "/v1/traces"
    return cfg.endpoint


def check_tracing_start(cfg: Any) -> dict[str, str]:
    """At start-up, with tracing enabled: the ``otel`` extra is installed, and every header's environment variable is
    set. Returns the headers with their values (never logged)."""
    from ..extras import require

    require("otel", f"{KEY}.enabled=true")
    headers = {}
    for name, var in cfg.headers.items():
        value = os.environ.get(var)
        if not value:
            raise ConfigError(f"{KEY}.headers.{name} reads the environment variable {var}, which is not set",
                              key=f"{KEY}.headers.{name}")
        headers[name] = value
    return headers


def _check_bool(cfg: Any, name: str) -> None:
    if not isinstance(getattr(cfg, name), bool):
        raise ConfigError(f"{KEY}.{name} must be true or false", key=f"{KEY}.{name}")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
