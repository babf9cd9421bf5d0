"""What an alias means to a running scenario: names that point at its releases, one of them the head.

* ``production`` is the release serving now (the head, or a weights scenario's live version). It is not stored
  apart: moving it is a rollback (or, for a release held for review, a promote) through the learner's own
  republish path, so what serves changes one way only, and its history is the release chain itself, whose
  republished releases name who moved it and why (``source.by``, ``source.reason``).
* Every other name (``staging``, custom ones) is kept in the release repository's alias log
  (:class:`~reef_core.commit.aliases.AliasLog`): each move recorded with who, when, from which release, to which,
  and why. Moving one changes nothing that serves; a request may pin it (``x-reef-release``) where the surface can
  serve a release other than the head (:func:`pinnable`).
"""

from __future__ import annotations

import re

from ..errors import NotFound, ValidationFailed

PRODUCTION = "production"
#: An alias name: a lowercase letter, then up to 62 of ``a-z 0-9 . _ -`` (never a 40-hex release id).
NAME = re.compile(r"[a-z][a-z0-9._-]{0,62}")
_RELEASE_ID = re.compile(r"[0-9a-f]{40}")
REASON_LIMIT = 500


def check_name(name, field: str = "alias") -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name) or _RELEASE_ID.fullmatch(name):
        raise ValidationFailed(f"{field}: an alias name is a lowercase letter then up to 62 of a-z, 0-9, '.', '_', "
                               "'-' (and not a 40-hex release id)", param=field)
    return name


def check_reason(reason) -> str:
    if not isinstance(reason, str) or not reason.strip() or len(reason) > REASON_LIMIT:
        raise ValidationFailed(f"reason: a non-empty string of at most {REASON_LIMIT} characters says why the alias "
                               "moves (it is kept in the audit)", param="reason")
    if any(ord(c) < 32 and c not in "\t\n" or c in "\x7f\u2028\u2029" for c in reason):
        raise ValidationFailed("reason: no control characters", param="reason")
    return reason


def chain(rows: list[dict]) -> list[dict]:
    """The scenario's release chain newest first: from the head along ``parent_release_id`` (held and promoted
    side releases and a live version are not part of it)."""
    by_id = {row["release_id"]: row for row in rows if isinstance(row.get("release_id"), str)}
    head = next((row for row in rows if row.get("current") and row.get("checkpoint", True)), None)
    if head is None:  # a live version serves: the chain starts at the durable release under it
        live = next((row for row in rows if row.get("current")), None)
        head = by_id.get((live or {}).get("parent_release_id"))
    out, seen = [], set()
    while head is not None and head["release_id"] not in seen:
        seen.add(head["release_id"])
        out.append(head)
        head = by_id.get(head.get("parent_release_id"))
    return out


def production(rows: list[dict]) -> dict | None:
    """``production`` as the alias listing shows it: the release serving now and how it came to."""
    current = next((row for row in rows if row.get("current")), None)
    if current is None:
        return None
    source = current.get("source") or {}
    return {"alias": PRODUCTION, "release_id": current["release_id"], "moved_at": current.get("created_at"),
            "moved_by": source.get("by"), "reason": source.get("reason") or source.get("kind") or
            current.get("operation")}


def production_history(rows: list[dict], limit: int) -> list[dict]:
    """Every head move of the chain, newest first, in the alias log's shape (``operation`` says what moved it)."""
    moves = []
    for row in chain(rows)[:limit]:
        source = row.get("source") or {}
        moves.append({"alias": PRODUCTION, "from": row.get("parent_release_id"), "to": row["release_id"],
                      "at": row.get("created_at"), "by": source.get("by"), "operation": row.get("operation"),
                      "reason": source.get("reason") or source.get("kind") or row.get("operation"),
                      "target_release_id": source.get("release_id")})
    return moves


def named(value: str, rows: list[dict], aliases: dict[str, str]) -> str | None:
    """The release ``value`` names among the scenario's releases: a release id, ``production`` or an alias."""
    if value == PRODUCTION:
        found = production(rows)
        return found["release_id"] if found else None
    if value in aliases:
        return aliases[value]
    return value if any(row.get("release_id") == value for row in rows) else None


def target(release_id, rows: list[dict]) -> dict:
    """The release row an alias move names (body field ``release``): 400 when it is not a string, 404 when the
    scenario has no such durable release (a live version has no files to point at)."""
    if not isinstance(release_id, str) or not release_id or len(release_id) > 200:
        raise ValidationFailed("release: a release id of the scenario is required", param="release")
    row = next((r for r in rows if r.get("release_id") == release_id and r.get("checkpoint", True)), None)
    if row is None:
        raise NotFound(f"release: the scenario has no release {release_id[:80]!r}", param="release")
    return row


def pinnable(surface) -> bool:
    """Whether the surface serves a request from a release other than its head (harness trees: the release's
    files shape that one request; weights and skill pools serve their one loaded state)."""
    return bool(getattr(surface, "pins_releases", False))
