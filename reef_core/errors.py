"""Reef's exception hierarchy.

Each error carries the HTTP status it maps to, so every surface (HTTP routes, CLI) reports
the same condition the same way. The CLI maps :class:`ConfigError` to exit code 2.
"""

from __future__ import annotations


class ReefError(Exception):
    """Base class of every error Reef raises on purpose."""

    status = 400
    code = "reef_error"

    def __init__(self, message: str, **details):
        super().__init__(message)
        self.message = message
        self.details = details

    @property
    def param(self) -> str | None:
        """The request field the error is about (``ValidationFailed(..., param="max_tokens")``), if any."""
        return self.details.get("param")


class ConfigError(ReefError):
    """The configuration is invalid (bad value, unknown recipe, missing component)."""

    code = "invalid_config"


class PluginError(ReefError):
    """A plugin could not be loaded or registered something invalid."""

    code = "plugin_error"


class ComponentConflict(PluginError):
    """Two plugins claimed the same component name."""

    code = "component_conflict"


class UnknownComponent(ConfigError):
    """Config names a component no plugin registered."""

    code = "unknown_component"


class NotFound(ReefError):
    status = 404
    code = "not_found"


class Forbidden(ReefError):
    """The token may not do this, or not on this scenario (a scoped token: :mod:`reef_core.serve.middleware.tenancy`)."""

    status = 403
    code = "forbidden"


class RateLimited(ReefError):
    """Over a request, token or budget limit; ``retry_after`` (seconds) goes out as the ``retry-after`` header."""

    status = 429
    code = "rate_limited"


class Conflict(ReefError):
    """A write conflicts with stored state (record id reuse, CAS loss, non-restorable release)."""

    status = 409
    code = "conflict"


class ActivationFailed(Conflict):
    """A committed release could not be activated; the head was restored to the release that still serves."""

    code = "activation_failed"


class Gone(ReefError):
    """The thing asked for existed and was removed on purpose (a record's body compacted by retention): 410."""

    status = 410
    code = "gone"


class ValidationFailed(ReefError):
    status = 400
    code = "invalid_request"


class PayloadTooLarge(ReefError):
    status = 413
    code = "payload_too_large"


class UpstreamError(ReefError):
    """The inference provider failed (5xx -> 502)."""

    status = 502
    code = "upstream_error"


class UpstreamUnavailable(UpstreamError):
    """The provider answered 503 (overloaded, down for a while): relayed as a 503 with its ``retry_after``, so a
    client backs off as the provider asked instead of seeing a 502 to retry at once."""

    status = 503
    code = "upstream_unavailable"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


class StorageUnavailable(ReefError):
    status = 503
    code = "storage_unavailable"


class ScenarioQuarantined(ReefError):
    """The scenario's stored state could not be loaded (learner, recovery or validation failed); it serves nothing
    until fixed or archived, while every other scenario serves."""

    status = 503
    code = "scenario_quarantined"
