"""Tenancy: who a token is (a :class:`Principal`), what it may do (scopes) and on which scenarios (patterns).

``server.scoped_tokens`` entries name a token (``token``, ``token_sha256``, ``token_env`` or ``token_file``), the
scenarios it may touch (fnmatch patterns), its scopes (``infer``, ``report``, ``read``, ``admin``; default the first
three) and optional limits (``rpm``, ``tpm``, ``budget_tokens``, ``budget_period``: see :mod:`reef_core.serve.middleware.usage`).
Plain ``server.tokens`` / ``server.admin_tokens`` (and ``REEF_TOKEN`` / ``REEF_ADMIN_TOKEN``) stay all-scenario
principals. Everything is checked when the app is built; a mistake is a :class:`ConfigError` naming the entry and key.

Record ids are scoped per scenario in the store (its key is the scenario and the id): a token learns nothing of the
ids of scenarios it may not see, since another scenario's id is simply not there, and no team can claim an id first
and lock another out of it.

The request path only hashes the presented token and looks the digest up in a dict (a digest reveals nothing about
the token, so no constant-time compare is needed), and a pattern match is cached per principal and scenario: no
database round trip.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reef_core.errors import ConfigError, Forbidden

#: ``pin``: an inference may pin a release other than the head (``x-reef-release``); admin tokens may too.
#: ``eval``: ``POST /reef/scenarios/{s}/evaluate`` (a release answers on the private engine; admin tokens may too).
SCOPES = ("infer", "report", "read", "admin", "pin", "eval")
DEFAULT_SCOPES = frozenset({"infer", "report", "read"})
PERIODS = ("day", "month", "total")
TOKEN_SOURCES = ("token", "token_sha256", "token_env", "token_file")
ENTRY_KEYS = frozenset({"name", "scenarios", "scopes", "rpm", "tpm", "budget_tokens", "budget_period",
                        *TOKEN_SOURCES})
LIMIT_KEYS = frozenset({"scenarios", "rpm", "tpm", "budget_tokens", "budget_period"})
#: Bound of each principal's (scenario -> allowed) cache; past it the cache starts over (names are client-chosen).
_CACHE_SIZE = 4096
_HEX64 = re.compile(r"[0-9a-f]{64}")


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True)
class Limits:
    rpm: int | None = None
    tpm: int | None = None
    budget_tokens: int | None = None
    budget_period: str = "month"

    @property
    def any(self) -> bool:
        return self.rpm is not None or self.tpm is not None or self.budget_tokens is not None


@dataclass(eq=False)
class Principal:
    """One configured token: its name (logged; the token never is), scopes and scenario patterns."""

    name: str
    scopes: frozenset[str]
    #: ``None``: every scenario (a plain token).
    patterns: tuple[str, ...] | None = None
    limits: Limits | None = None
    _allowed: dict[str, bool] = field(default_factory=dict, repr=False)

    @property
    def all_scenarios(self) -> bool:
        return self.patterns is None

    @property
    def legacy_scope(self) -> str:
        """The two-level scope older code reads (``admin`` or ``inference``)."""
        return "admin" if "admin" in self.scopes else "inference"

    def allows(self, scenario: str) -> bool:
        if self.patterns is None:
            return True
        found = self._allowed.get(scenario)
        if found is None:
            if len(self._allowed) >= _CACHE_SIZE:
                self._allowed.clear()
            # fnmatchcase: the same answer on every OS (fnmatch folds case on Windows).
            found = self._allowed[scenario] = any(fnmatch.fnmatchcase(scenario, p) for p in self.patterns)
        return found


#: The principal of a deployment with authentication off: everything is allowed.
OPEN = Principal("open", frozenset(SCOPES))


class Tenancy:
    """Every token's principal by SHA-256 digest, plus the per-scenario limit rules."""

    def __init__(self, principals: dict[bytes, Principal], scenario_limits: list[tuple[tuple[str, ...], Limits]]):
        self.by_digest = principals
        self.scenario_limits = scenario_limits
        self._limit_cache: dict[str, tuple[int, Limits] | None] = {}

    @classmethod
    def from_config(cls, server_cfg) -> "Tenancy":
        principals: dict[bytes, Principal] = {}

        def add(token_digest: bytes, principal: Principal, where: str) -> None:
            if token_digest in principals:
                raise ConfigError(f"{where}: the same token is configured twice "
                                  f"(also as {principals[token_digest].name!r})")
            principals[token_digest] = principal

        # Empty strings are dropped so an unset variable never becomes a credential; a plain token listed twice
        # (rotation lists) is one principal.
        plain = [(f"tokens[{i}]", t, DEFAULT_SCOPES) for i, t in enumerate(dict.fromkeys(server_cfg.tokens)) if t]
        if os.environ.get("REEF_TOKEN"):
            plain.append(("REEF_TOKEN", os.environ["REEF_TOKEN"], DEFAULT_SCOPES))
        plain += [(f"admin_tokens[{i}]", t, frozenset(SCOPES))
                  for i, t in enumerate(dict.fromkeys(server_cfg.admin_tokens)) if t]
        if os.environ.get("REEF_ADMIN_TOKEN"):
            plain.append(("REEF_ADMIN_TOKEN", os.environ["REEF_ADMIN_TOKEN"], frozenset(SCOPES)))
        for name, token, scopes in plain:
            known = principals.get(digest(token))
            # A token both plain and admin is admin (as before); a plain token is named by its place in the config.
            if known is None or "admin" in scopes:
                principals[digest(token)] = Principal(name, scopes)
        names: set[str] = set()
        for i, entry in enumerate(getattr(server_cfg, "scoped_tokens", None) or []):
            where = f"server.scoped_tokens[{i}]"
            principal, token_digest = _scoped_entry(_plain_dict(entry, where), where)
            if principal.name in names:
                raise ConfigError(f"{where}.name: {principal.name!r} names two scoped tokens")
            names.add(principal.name)
            add(token_digest, principal, where)
        rules = []
        for i, entry in enumerate(getattr(server_cfg, "scenario_limits", None) or []):
            where = f"server.scenario_limits[{i}]"
            entry = _plain_dict(entry, where)
            unknown = sorted(set(entry) - LIMIT_KEYS)
            if unknown:
                raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(LIMIT_KEYS))}")
            limits = _limits(entry, where)
            if not limits.any:
                raise ConfigError(f"{where}: set at least one of rpm, tpm, budget_tokens")
            rules.append((_patterns(entry, where), limits))
        return cls(principals, rules)

    @property
    def enabled(self) -> bool:
        return bool(self.by_digest)

    def principal(self, token: str) -> Principal | None:
        return self.by_digest.get(digest(token))

    def principals(self) -> list[Principal]:
        return list(self.by_digest.values())

    def scenario_limit(self, scenario: str) -> tuple[int, Limits] | None:
        """The first ``server.scenario_limits`` rule matching ``scenario`` (its index and limits), cached."""
        if not self.scenario_limits:
            return None
        try:
            return self._limit_cache[scenario]
        except KeyError:
            pass
        if len(self._limit_cache) >= _CACHE_SIZE:
            self._limit_cache.clear()
        found = next(((i, limits) for i, (patterns, limits) in enumerate(self.scenario_limits)
                      if any(fnmatch.fnmatchcase(scenario, p) for p in patterns)), None)
        self._limit_cache[scenario] = found
        return found


def _plain_dict(entry: Any, where: str) -> dict:
    if type(entry).__module__.startswith("omegaconf"):  # a node handed in by a caller that composed in-process;
        from omegaconf import OmegaConf  # imported only then: a composed config holds plain dicts

        entry = OmegaConf.to_container(entry, resolve=True)
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be a mapping (got {type(entry).__name__})")
    return dict(entry)


def _patterns(entry: dict, where: str) -> tuple[str, ...]:
    patterns = entry.get("scenarios")
    if isinstance(patterns, str):
        patterns = [patterns]
    if not isinstance(patterns, list) or not patterns:
        raise ConfigError(f"{where}.scenarios must be a non-empty list of scenario patterns (fnmatch, e.g. 'team-a-*')")
    for j, pattern in enumerate(patterns):
        if not isinstance(pattern, str) or not pattern.strip():
            raise ConfigError(f"{where}.scenarios[{j}] must be a non-empty pattern")
    return tuple(patterns)


def _positive(entry: dict, key: str, where: str) -> int | None:
    value = entry.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}.{key} must be a positive integer (got {value!r})")
    return value


def _limits(entry: dict, where: str) -> Limits:
    period = entry.get("budget_period", "month")
    if period not in PERIODS:
        raise ConfigError(f"{where}.budget_period must be one of {', '.join(PERIODS)} (got {period!r})")
    return Limits(rpm=_positive(entry, "rpm", where), tpm=_positive(entry, "tpm", where),
                  budget_tokens=_positive(entry, "budget_tokens", where), budget_period=period)


def _scoped_entry(entry: dict, where: str) -> tuple[Principal, bytes]:
    unknown = sorted(set(entry) - ENTRY_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(ENTRY_KEYS))}")
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{where}.name must be a non-empty string (it names the token in logs and status)")
    scopes = entry.get("scopes")
    if scopes is None:
        scopes = sorted(DEFAULT_SCOPES)
    if isinstance(scopes, str):
        scopes = [scopes]
    if not isinstance(scopes, list) or not scopes:
        raise ConfigError(f"{where}.scopes must be a non-empty list of {', '.join(SCOPES)}")
    for scope in scopes:
        if scope not in SCOPES:
            raise ConfigError(f"{where}.scopes: unknown scope {scope!r}; known: {', '.join(SCOPES)}")
    limits = _limits(entry, where)
    principal = Principal(name=name, scopes=frozenset(scopes), patterns=_patterns(entry, where),
                          limits=limits if limits.any else None)
    return principal, _token_digest(entry, where)


def _token_digest(entry: dict, where: str) -> bytes:
    given = [key for key in TOKEN_SOURCES if entry.get(key) not in (None, "")]
    if len(given) != 1:
        raise ConfigError(f"{where}: give exactly one of {', '.join(TOKEN_SOURCES)} "
                          f"({'none' if not given else ', '.join(given)} given)")
    key = given[0]
    value = entry[key]
    if not isinstance(value, str):
        raise ConfigError(f"{where}.{key} must be a string")
    if key == "token_sha256":
        if not _HEX64.fullmatch(value.lower()):
            raise ConfigError(f"{where}.token_sha256 must be 64 hexadecimal digits (sha256 of the token)")
        return bytes.fromhex(value)
    if key == "token_env":
        token = os.environ.get(value, "")
        if not token:
            raise ConfigError(f"{where}.token_env: environment variable {value!r} is unset or empty")
    elif key == "token_file":
        try:
            token = Path(value).expanduser().read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{where}.token_file: cannot read {value!r}: {exc.strerror}") from None
        if not token:
            raise ConfigError(f"{where}.token_file: {value!r} is empty")
    else:
        token = value
    return digest(token)


# -- per-request checks ----------------------------------------------------------------------------------------


def principal_of(scope: dict) -> Principal:
    """The request's principal (set by the auth middleware; everything-allowed when authentication is off)."""
    return (scope.get("state") or {}).get("reef_principal") or OPEN


def check_scenario(scope: dict, scenario: str) -> None:
    """403 naming ``scenario`` when the request's token is not scoped to it."""
    principal = principal_of(scope)
    if not principal.allows(scenario):
        raise Forbidden(f"token {principal.name!r} is not scoped to scenario {scenario!r}", scenario=scenario)


def visible(scope: dict, items: list, name=lambda item: item.name) -> list:
    """The entries of a scenario listing the request's token may see."""
    principal = principal_of(scope)
    return items if principal.all_scenarios else [item for item in items if principal.allows(name(item))]
