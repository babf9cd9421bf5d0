"""The grammar of client-chosen names: scenario names and record ids, checked at the door of every route.

Scenario names (``x-reef-scenario``, ``{s}`` in ``/reef/scenarios/{s}/...``):

* 1 to :data:`MAX_SCENARIO_BYTES` bytes of UTF-8 (a header's bytes are decoded as UTF-8; invalid UTF-8 is refused);
* no control characters (Unicode category ``Cc``: TAB, CR, LF, NUL, DEL, ...), no line or paragraph separators,
  no ``/``, no leading or trailing whitespace, and not ``.`` or ``..`` (URL paths cannot address those);
* anything else is allowed (spaces, dots, any script) and names are compared byte for byte: ``Math`` and ``math``
  are two scenarios. Nothing on disk or in git is named after the text: files and refs use
  :func:`scenario_digest`, so any accepted name works.

Record ids (``x-reef-agent-record-id``, a report's ``agent_record_id`` and ``references``, ``Idempotency-Key``,
``{id}`` in record routes): 1 to :data:`MAX_ID_LENGTH` ASCII characters from ``A-Z a-z 0-9 - _ . :``, starting
with a letter or a digit, so every id can travel in a header and in a URL path unchanged.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

from reef_core.errors import ValidationFailed

MAX_SCENARIO_BYTES = 200
MAX_ID_LENGTH = 128

SCENARIO_RULE = (f"1-{MAX_SCENARIO_BYTES} bytes of UTF-8 without control characters, '/', "
                 "or leading/trailing whitespace, and not '.' or '..'")
ID_RULE = f"1-{MAX_ID_LENGTH} characters of A-Z a-z 0-9 '-' '_' '.' ':', starting with a letter or digit"

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,%d}" % (MAX_ID_LENGTH - 1))
_SEPARATORS = frozenset("\u2028\u2029\x85")


def scenario_problem(name: object) -> str | None:
    """Why ``name`` is not a valid new scenario name, or None when it is."""
    if not isinstance(name, str) or not name:
        return "is missing or empty"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # lone surrogates
        return "is not valid Unicode text"
    if size > MAX_SCENARIO_BYTES:
        return f"is {size} bytes long; the limit is {MAX_SCENARIO_BYTES} bytes of UTF-8"
    if "/" in name:
        return "contains '/'"
    if name in (".", ".."):
        return f"is {name!r}"
    if name != name.strip():
        return "has leading or trailing whitespace"
    for char in name:
        if char in _SEPARATORS or unicodedata.category(char) == "Cc":
            return f"contains the control character U+{ord(char):04X}"
    return None


def check_scenario_name(name: object, field: str = "scenario") -> str:
    """Return ``name`` if it follows the scenario-name rule, else raise :class:`ValidationFailed` naming ``field``."""
    problem = scenario_problem(name)
    if problem is not None:
        raise ValidationFailed(f"{field} {problem}; a scenario name is {SCENARIO_RULE}", field=field)
    return name  # type: ignore[return-value]


def header_text(raw: str, field: str) -> str:
    """A header value as the client sent it: Starlette decodes header bytes as latin-1, this re-reads them as
    UTF-8 (invalid UTF-8 is a :class:`ValidationFailed` naming ``field``)."""
    try:
        return raw.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        raise ValidationFailed(f"{field} is not valid UTF-8", field=field) from None


def check_record_id(value: object, field: str) -> str:
    """Return ``value`` if it follows the record-id grammar, else raise :class:`ValidationFailed` naming ``field``."""
    if not isinstance(value, str) or _ID.fullmatch(value) is None:
        raise ValidationFailed(f"{field} must be {ID_RULE}", field=field)
    return value


def is_record_id(value: object) -> bool:
    return isinstance(value, str) and _ID.fullmatch(value) is not None


def scenario_digest(name: str) -> str:
    """The fixed-length key (64 hex digits) that names a scenario's files, directories and git refs: any string
    works, names differing only in case stay apart on case-insensitive file systems, and no name is too long."""
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
