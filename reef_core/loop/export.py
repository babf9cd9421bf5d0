"""A scenario's records as a dataset: the selection (``--since``, ``--release``, ``--scored-only``) and the rows of
each export format. ``reef export`` (:mod:`reef_core.loop.export_command`) and ``GET /reef/scenarios/{s}/export``
both read it.

Formats:

* ``openai-jsonl``: OpenAI's chat fine-tuning lines, ``{"messages": [...request turns, the assistant reply],
  "tools"?}``; both dialects normalised to OpenAI turns by :mod:`reef_core.observe.processors.conversation`, the
  tools of an Anthropic request by the dialect translation. It is training data, not a copy: it cannot be imported
  back exactly (ids, reports and the served exchange are gone).
* ``reef-jsonl``: the import's own envelopes (``POST /reef/records/batch``, ``reef import``), each record's stored
  payload verbatim, reports after what they quote: imported into a deployment under the same scenario name, every
  record has the content hash it had here (:mod:`reef_core.observe.stored_form`). This is the round-trip format.
* ``hf`` / ``parquet`` (the CLI only): one row per inference record with its turns, reply, scores, feedback, release,
  version, tags, id, time and content hash (:data:`ROW_FIELDS`).

Only what an import can take back is exported: complete chat exchanges (``chat``/``messages`` routes) and reports;
a report only when every record it quotes is exported too (so a cut by ``--since`` never leaves a dangling
reference). ``train`` records (a person's instructions), incomplete exchanges and exchanges whose bodies retention
compacted (:mod:`reef_core.observe.compacted`) are left out.

Records are read from the store page by page. What is held across the scan is small per record: the scores and
feedback of reports (read in a first pass, only when the selection or the format needs them) and, for
``reef-jsonl``, the ids exported so far.
"""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from ..engines.translate import anthropic_tools_to_openai
from ..errors import NotFound, ValidationFailed
from ..observe.compacted import is_compacted
from ..observe.model import canonical_json
from ..observe.processors.conversation import UnusableRecord, exchange_of
from .release_compare import version_table

FORMATS = ("openai-jsonl", "reef-jsonl", "hf", "parquet")
#: The formats written line by line (the route streams these; ``hf`` and ``parquet`` are files the CLI writes).
LINE_FORMATS = ("openai-jsonl", "reef-jsonl")
CHAT_ROUTES = ("chat", "messages")
ROLES = ("system", "user", "assistant", "tool")
#: The columns of an ``hf`` / ``parquet`` row.
ROW_FIELDS = ("record_id", "scenario", "sequence", "created_at", "content_hash", "dialect", "messages", "reply",
              "tools", "score", "scores", "feedback", "release", "version", "tags")
#: Bound of a ``since`` sequence: the stores hold sequences as signed 64-bit integers.
MAX_SEQUENCE = 2**63 - 1
_RELEASE_PREFIX = re.compile(r"[0-9a-f]{7,40}")

#: ``iterate(after_sequence)``: a scenario's records after a sequence, oldest first, read page by page.
Iterate = Callable[[int], Iterator]


@dataclass(frozen=True)
class Selection:
    """Which records an export takes: after a sequence or from a time on, served by one release, scored."""

    after_sequence: int = 0
    since_time: float | None = None
    #: A release id of the scenario (:func:`release_named` resolves a prefix); a record's is :func:`served_release`.
    release: str | None = None
    scored_only: bool = False

    def wants_reports_first(self, fmt: str) -> bool:
        return self.scored_only or fmt in ("hf", "parquet")


def check_format(value: str, flag: str, allowed: tuple[str, ...] = FORMATS) -> str:
    if value not in allowed:
        raise ValidationFailed(f"{flag} must be one of {', '.join(allowed)}, not {value[:40]!r}", param=flag)
    return value


def parse_since(value: str, flag: str) -> tuple[int, float | None]:
    """``(after_sequence, since_time)`` of a ``since`` value: a record sequence (records after it, as the records
    route's ``after_sequence``), or an ISO-8601 time (records created at or after it; UTC when it names no zone)."""
    text = value.strip()
    if text.isascii() and text.isdigit():
        sequence = int(text)
        if sequence > MAX_SEQUENCE:
            raise ValidationFailed(f"{flag}: a sequence is at most {MAX_SEQUENCE}", param=flag)
        return sequence, None
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise ValidationFailed(f"{flag} must be an ISO-8601 time (2026-12-01T00:00:00Z) or a record sequence "
                               f"number, not {value[:60]!r}", param=flag) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return 0, moment.timestamp()


def release_named(value: str, release_rows: list[dict], scenario: str, flag: str) -> str:
    """The release id of ``scenario`` that ``value`` names (the id, or a unique prefix of 7+ hex digits);
    :class:`ValidationFailed` for a malformed one, :class:`NotFound` for one the scenario lacks."""
    wanted = value.strip().lower()
    if not _RELEASE_PREFIX.fullmatch(wanted):
        raise ValidationFailed(f"{flag}: a release id is 7 to 40 hex digits, not {value[:60]!r}", param=flag)
    hits = sorted({row["release_id"] for row in release_rows
                   if isinstance(row.get("release_id"), str) and row["release_id"].startswith(wanted)})
    if not hits:
        raise NotFound(f"{flag}: scenario {scenario!r} has no release {value!r}", param=flag)
    if len(hits) > 1:
        raise ValidationFailed(f"{flag} {value!r} names {len(hits)} releases of scenario {scenario!r}; give more "
                               "digits", param=flag)
    return hits[0]


@dataclass
class Reports:
    """What the reports say of each inference record, oldest report first."""

    scores: dict[str, list[float]] = field(default_factory=dict)
    feedback: dict[str, list[str]] = field(default_factory=dict)

    def add(self, report) -> None:
        score = report.payload.get("score")
        finite = not isinstance(score, bool) and isinstance(score, (int, float)) and math.isfinite(score)
        feedback = report.payload.get("feedback")
        for ref in report.references:
            if finite:
                self.scores.setdefault(ref, []).append(float(score))
            if feedback is not None:
                self.feedback.setdefault(ref, []).append(
                    feedback if isinstance(feedback, str) else canonical_json(feedback))


def read_reports(iterate: Iterate) -> Reports:
    reports = Reports()
    for record in iterate(0):
        if record.kind == "report":
            reports.add(record)
    return reports


def served_release(record, versions: Mapping[str, str]) -> str | None:
    """The release that served ``record`` (its engine version, else the harness release in its payload)."""
    found = versions.get(record.version) if record.version else None
    return found or versions.get(record.payload.get("release_id"))


def _exportable(record) -> bool:
    """A complete chat exchange whose bodies retention has not dropped (a compacted record cannot be imported)."""
    return (record.kind == "inference" and record.complete and record.payload.get("route") in CHAT_ROUTES
            and not is_compacted(record))


def selected(iterate: Iterate, selection: Selection, versions: Mapping[str, str],
             reports: Reports | None) -> Iterator:
    """The records an export takes, oldest first: exportable inference records passing the selection, and reports
    (filtered by time alone; the writer keeps those whose references it exported)."""
    for record in iterate(selection.after_sequence):
        if selection.since_time is not None and record.created_at < selection.since_time:
            continue
        if record.kind == "report":
            yield record
            continue
        if not _exportable(record):
            continue
        if selection.release is not None and served_release(record, versions) != selection.release:
            continue
        if selection.scored_only and not (reports and reports.scores.get(record.record_id)):
            continue
        yield record


# -- openai-jsonl ----------------------------------------------------------------------------------------------------


def _openai_turn(turn: dict) -> dict | None:
    """A normalised turn as OpenAI's fine-tuning format takes it, or None when it cannot be one."""
    role = turn.get("role")
    if role not in ROLES:
        return None
    out: dict = {"role": role, "content": turn.get("content") or ""}
    calls = turn.get("tool_calls")
    if calls:
        if role != "assistant" or not all(isinstance(c.get("id"), str) and isinstance(c["function"].get("name"), str)
                                          for c in calls):
            return None
        out["tool_calls"] = calls
        if not out["content"]:
            out["content"] = None  # an assistant turn that only calls tools has no text, as OpenAI answers it
    if role == "tool":
        if not isinstance(turn.get("tool_call_id"), str):
            return None
        out["tool_call_id"] = turn["tool_call_id"]
    return out


def _openai_tools(payload: dict) -> list[dict]:
    """The function tools the request offered, in OpenAI's shape (an Anthropic server tool has none)."""
    tools = (payload.get("request") or {}).get("tools")
    if not isinstance(tools, list):
        return []
    if payload.get("dialect") == "anthropic":
        out = []
        for tool in tools:
            try:
                out.extend(anthropic_tools_to_openai([tool]) if isinstance(tool, dict) else [])
            except ValidationFailed:
                continue
        tools = out
    return [t for t in tools if isinstance(t, dict) and t.get("type") == "function"
            and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)]


def _turns(record) -> tuple[list[dict], dict] | None:
    try:
        messages, reply = exchange_of(record)
    except UnusableRecord:
        return None
    turns = [_openai_turn(m) for m in messages]
    last = _openai_turn({**reply, "role": "assistant"})
    if last is None or any(t is None for t in turns):
        return None
    return turns, last


def openai_example(record) -> dict | None:
    """One fine-tuning line, or None for an exchange the format cannot hold (a turn of another role, a tool call
    without an id)."""
    found = _turns(record)
    if found is None:
        return None
    turns, reply = found
    line: dict = {"messages": [*turns, reply]}
    tools = _openai_tools(record.payload)
    if tools:
        line["tools"] = tools
    return line


# -- reef-jsonl ------------------------------------------------------------------------------------------------------


def envelope(record) -> dict:
    """The import envelope that stores ``record`` again with its content hash (payload verbatim)."""
    payload = dict(record.payload)
    if record.kind == "report":
        payload["references"] = list(record.references)
    out = {"agent_record_id": record.record_id, "request_type": record.kind, "payload": payload}
    if record.tags:
        out["tags"] = dict(record.tags)
    return out


# -- hf / parquet ----------------------------------------------------------------------------------------------------


def _message(turn: dict) -> dict:
    return {"role": turn["role"], "content": turn.get("content"), "tool_calls": turn.get("tool_calls"),
            "tool_call_id": turn.get("tool_call_id")}


def dataset_row(record, reports: Reports, versions: Mapping[str, str]) -> dict | None:
    """One ``hf`` / ``parquet`` row (:data:`ROW_FIELDS`); ``tools``, ``tags`` and object feedback as JSON text."""
    found = _turns(record)
    if found is None:
        return None
    turns, reply = found
    tools = _openai_tools(record.payload)
    scores = reports.scores.get(record.record_id, [])
    return {
        "record_id": record.record_id, "scenario": record.scenario, "sequence": record.sequence,
        "created_at": datetime.datetime.fromtimestamp(record.created_at, datetime.timezone.utc),
        "content_hash": record.content_hash, "dialect": record.payload.get("client_dialect"),
        "messages": [_message(t) for t in turns], "reply": _message(reply),
        "tools": canonical_json(tools) if tools else None,
        "score": scores[-1] if scores else None,  # the latest report corrects earlier ones
        "scores": scores, "feedback": reports.feedback.get(record.record_id, []),
        "release": served_release(record, versions), "version": record.version,
        "tags": canonical_json(dict(record.tags)),
    }


# -- the scan --------------------------------------------------------------------------------------------------------


@dataclass
class Tally:
    """What an export wrote and left out."""

    written: int = 0
    #: Exchanges the format cannot hold, and reports quoting a record the export left out.
    skipped: int = 0


def lines(iterate: Iterate, fmt: str, selection: Selection, versions: Mapping[str, str],
          tally: Tally | None = None) -> Iterator[dict]:
    """The export's lines (``openai-jsonl`` / ``reef-jsonl``) or rows (``hf`` / ``parquet``) as JSON-ready dicts."""
    tally = tally if tally is not None else Tally()
    reports = read_reports(iterate) if selection.wants_reports_first(fmt) else None
    exported: set[str] = set()  # reef-jsonl: a report is kept only when what it quotes was exported
    for record in selected(iterate, selection, versions, reports):
        if record.kind == "report":
            if fmt == "reef-jsonl" and exported.issuperset(record.references):
                exported.add(record.record_id)
                tally.written += 1
                yield envelope(record)
            elif fmt == "reef-jsonl":
                tally.skipped += 1
            continue
        if fmt == "reef-jsonl":
            row = envelope(record)
            exported.add(record.record_id)
        elif fmt == "openai-jsonl":
            row = openai_example(record)
        else:
            row = dataset_row(record, reports, versions)
        if row is None:
            tally.skipped += 1
            continue
        tally.written += 1
        yield row


def json_line(row: dict) -> str:
    """One line of a JSONL export (canonical JSON: the same records give the same bytes)."""
    return canonical_json(row) + "\n"


#: How the route names its parameters (the CLI passes its flags: ``--since``...).
PARAMS = {"format": "format", "since": "since", "release": "release"}


def plan(replay: Callable[[str, int], Iterator], scenario: str, release_rows: list[dict], fmt: str, *,
         since: str | None = None, release: str | None = None, scored_only: bool = False,
         names: Mapping[str, str] = PARAMS, tally: Tally | None = None) -> Iterator[dict]:
    """Check every argument now (:class:`ValidationFailed` / :class:`NotFound` naming it as ``names`` says), then
    return the export's rows, read lazily through ``replay(scenario, after_sequence)`` (the store's page-by-page
    read; the route has sent nothing yet when this refuses)."""
    check_format(fmt, names["format"])
    after_sequence, since_time = parse_since(since, names["since"]) if since is not None else (0, None)
    release_id = release_named(release, release_rows, scenario, names["release"]) if release is not None else None
    selection = Selection(after_sequence=after_sequence, since_time=since_time, release=release_id,
                          scored_only=scored_only)
    return lines(lambda after: replay(scenario, after), fmt, selection, version_table(release_rows), tally)
