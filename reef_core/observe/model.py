"""Value types of the record store: :class:`Record`, :class:`Scenario` and the content hash.

A record's ``content_hash`` covers only what defines the interaction (kind, scenario, payload, references), so a
client retry that re-sends the same body under the same id is recognised as identical even though bookkeeping
fields (tags, created_at, version) may differ.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from reef_core.errors import ValidationFailed

#: Record kinds the store accepts: served (or imported) exchanges, client reports, and a person's instructions
#: (``POST /reef/train``; never handed to a processor, see :mod:`reef_core.observe.instructions`).
KINDS = ("inference", "report", "train")

#: Longest record id, scenario name or idempotency key the store accepts (matches the column width).
MAX_ID_LENGTH = 255


# Built once: json.dumps with options builds a new encoder per call, which costs as much as encoding a small value.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def canonical_json(value: Any) -> str:
    """Deterministic JSON text: sorted keys, no spaces, UTF-8 kept, non-finite floats refused."""
    try:
        return _CANONICAL.encode(value)
    except (TypeError, ValueError) as exc:  # sets, bytes, NaN, ...: not storable as JSON either
        raise ValidationFailed(f"value is not canonical JSON: {exc}") from exc


def canonical_bytes(value: Any) -> bytes:
    """:func:`canonical_json` as UTF-8, what digests are taken over; a lone surrogate (not Unicode text, so not
    storable either) is a :class:`ValidationFailed` rather than an encoding error."""
    try:
        return canonical_json(value).encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationFailed("value holds a lone surrogate (an unpaired \\ud800-\\udfff escape), "
                               "which is not Unicode text") from None


# Records whose payload went through canonical_json when their content hash was computed, by id and held weakly:
# the writer may store those with a faster encoder that writes NaN as null instead of refusing it
# (reef_core.observe.batch.encode_json_columns). A side table rather than an attribute, so that
# ``Record(**record.__dict__)`` keeps working.
_CHECKED: weakref.WeakValueDictionary[int, Record] = weakref.WeakValueDictionary()


def payload_checked(record: Record) -> bool:
    """Whether ``record``'s payload passed :func:`canonical_json` when the record was built."""
    return _CHECKED.get(id(record)) is record


def compute_content_hash(kind: str, scenario: str, payload: dict, references: list[str]) -> str:
    """sha256 (hex) of the canonical JSON of the fields that define a record's content."""
    text = canonical_bytes({"kind": kind, "scenario": scenario, "payload": payload, "references": references})
    return hashlib.sha256(text).hexdigest()


def check_identifier(what: str, value: Any) -> str:
    """Return ``value`` if it is a usable id (non-empty string within :data:`MAX_ID_LENGTH`), else raise."""
    if not isinstance(value, str) or not value:
        raise ValidationFailed(f"{what} must be a non-empty string", field=what)
    if len(value) > MAX_ID_LENGTH:
        raise ValidationFailed(f"{what} is longer than {MAX_ID_LENGTH} characters", field=what)
    return value


@dataclass(frozen=True)
class Record:
    """One stored interaction (``inference``), client report (``report``) or instruction (``train``).

    ``record_id`` is the receipt: clients see it as ``agent_record_id`` (header
    ``x-reef-agent-record-id``, report references). ``version`` is what the engine served the
    inference with, not a release of the chain (those are ``release_id``s). ``sequence`` is ``None``
    until the store assigns it; ``content_hash`` is computed when not given.
    ``top_k`` is the packed top-K log-probs of the payload's token data
    (:meth:`reef_core.topk.TopK.pack`), stored in a binary column beside the JSON payload; it is derived
    from the same generation as ``payload["tokens"]``, so the content hash leaves it out.
    """

    record_id: str
    scenario: str
    kind: str
    payload: dict
    references: list[str] = field(default_factory=list)
    tags: dict = field(default_factory=dict)
    version: str | None = None
    complete: bool = True
    request_hash: str | None = None
    content_hash: str | None = None
    sequence: int | None = None
    created_at: float = field(default_factory=time.time)
    top_k: bytes | None = None

    def __post_init__(self) -> None:
        check_identifier("record_id", self.record_id)
        check_identifier("scenario", self.scenario)
        if self.kind not in KINDS:
            raise ValidationFailed(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}", field="kind")
        if not isinstance(self.payload, dict):
            raise ValidationFailed("payload must be a JSON object", field="payload")
        if not isinstance(self.references, list) or not all(isinstance(r, str) for r in self.references):
            raise ValidationFailed("references must be a list of strings", field="references")
        if not isinstance(self.tags, dict):
            raise ValidationFailed("tags must be a JSON object", field="tags")
        for name, longest in (("version", MAX_ID_LENGTH), ("request_hash", 128), ("content_hash", 128)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or len(value) > longest):
                raise ValidationFailed(f"{name} must be a string of at most {longest} characters, or None",
                                       field=name)
        if not isinstance(self.complete, bool):
            raise ValidationFailed("complete must be a boolean", field="complete")
        if not isinstance(self.created_at, (int, float)) or not math.isfinite(self.created_at):
            raise ValidationFailed("created_at must be a finite number", field="created_at")
        if self.top_k is not None and not isinstance(self.top_k, bytes):
            raise ValidationFailed("top_k must be bytes or None", field="top_k")
        if self.tags:
            canonical_json(self.tags)  # refuse unstorable tags now rather than inside a batch
        if self.content_hash is None:
            digest = compute_content_hash(self.kind, self.scenario, self.payload, self.references)
            object.__setattr__(self, "content_hash", digest)
            _CHECKED[id(self)] = self

    def with_sequence(self, sequence: int) -> Record:
        """A copy carrying the sequence the store assigned (no re-validation: the fields are already checked)."""
        clone = object.__new__(type(self))  # copy.copy's reduce protocol costs several times this per record
        clone.__dict__.update(self.__dict__)
        clone.__dict__["sequence"] = sequence
        return clone


@dataclass(frozen=True)
class Scenario:
    """A scenario row: its permanent recipe binding and whether it was archived."""

    name: str
    recipe: str
    created_at: float
    archived: bool = False
