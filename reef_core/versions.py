"""Served versions: the name of the weights that answered an inference (``Record.version``, ``engine.version``).

Grammar. A version is ``"<incarnation>:<seq>"``: the incarnation changes whenever the engine starts fresh, ``seq`` (a
non-negative integer) grows with every weight load inside one incarnation. The incarnation is everything before the
last colon. ``"base"`` (the unmodified weights of the local engine) is incarnation ``"base"``, sequence 0.

Adapter lines. A scenario trained through a LoRA adapter counts its own versions, ``"<incarnation>.<key>:<seq>"``
(``key`` is short and names the scenario), so only its own updates age its samples. Its first records are served by
the base before any adapter exists: the base version ``"<incarnation>:0"`` counts as sequence 0 of every adapter line
of that incarnation (:func:`on_line`).

:class:`ServedVersion` is one version as a value (parse, format, its adapter line, the next one); the functions are
the same grammar on plain strings and tuples, as the staleness rules (``reef_core.observe.processors.eligibility``)
and the trainer's version checks use it.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass

BASE = "base"


def parse_version(version: str) -> tuple[str, int]:
    """``"<incarnation>:<seq>"`` → ``(incarnation, seq)``; ``"base"`` → ``("base", 0)``. Raises ``ValueError``."""
    if not isinstance(version, str) or not version:
        raise ValueError(f"not a version: {version!r}")
    if version == BASE:
        return BASE, 0
    incarnation, sep, seq = version.rpartition(":")
    if not sep or not incarnation or not seq.isdigit() or not seq.isascii():
        raise ValueError(f"version {version!r} is not '<incarnation>:<seq>'")
    return incarnation, int(seq)


def format_version(incarnation: str, seq: int) -> str:
    """The inverse of :func:`parse_version` (``("base", 0)`` → ``"base"``)."""
    if incarnation == BASE and seq == 0:
        return BASE
    return f"{incarnation}:{int(seq)}"


def adapter_key(scenario: str) -> str:
    """A scenario's short, version-safe key in its adapter line (8 hex digits of its name's sha256). Not
    :func:`reef_core.commit.release.scenario_key`, the fixed-length key of its refs and file names."""
    return hashlib.sha256(scenario.encode()).hexdigest()[:8]


def adapter_line(incarnation: str, key: str) -> str:
    """The incarnation part of a scenario's adapter versions: ``"<incarnation>.<key>"``."""
    return f"{incarnation}.{key}"


def on_line(producing: tuple[str, int], serving: tuple[str, int]) -> tuple[str, int]:
    """``producing`` as a position on the serving version's line: the base ``(<incarnation>, 0)`` is sequence 0 of
    every adapter line ``<incarnation>.<key>`` (see the module docstring); any other version is left as it is."""
    incarnation, seq = producing
    if seq == 0 and serving[0].startswith(adapter_line(incarnation, "")):
        return serving[0], 0
    return producing


@dataclass(frozen=True)
class ServedVersion:
    """One served version: ``str()`` formats it, :meth:`parse` reads it back."""

    incarnation: str
    seq: int = 0

    @classmethod
    def parse(cls, version: str) -> ServedVersion:
        """Strictly (:func:`parse_version`): ``ValueError`` for what is not ``"<incarnation>:<seq>"`` or ``"base"``."""
        return cls(*parse_version(version))

    @classmethod
    def read(cls, version: str) -> ServedVersion:
        """Leniently, as a surface reads its engine's version: the incarnation is the text before the last colon
        (all of it when there is none), the sequence the digits after it (0 when they are not digits)."""
        incarnation, _, seq = str(version).rpartition(":")
        return cls(incarnation or str(version), int(seq) if seq.isdigit() else 0)

    @classmethod
    def fresh(cls) -> ServedVersion:
        """Sequence 0 of a new incarnation: what an engine serves when it starts, so that samples produced by the
        weights of an earlier process are never mistaken for current ones."""
        return cls(uuid.uuid4().hex[:8], 0)

    def __str__(self) -> str:
        return format_version(self.incarnation, self.seq)

    def next(self) -> ServedVersion:
        """The version of the next weight load on this line."""
        return ServedVersion(self.incarnation, self.seq + 1)

    def adapter_line(self, key: str) -> ServedVersion:
        """Sequence ``seq`` of the adapter line ``"<incarnation>.<key>"`` (a LoRA scenario's own versions)."""
        return ServedVersion(adapter_line(self.incarnation, key), self.seq)
