"""``POST /reef/records`` and ``POST /reef/records/batch``: import inference and report records without calling a model.

For cold start and for learning from existing logs. An envelope is exactly ``{"agent_record_id", "request_type":
"inference" | "report", "payload"}``; the answer is its receipt ``{agent_record_id, scenario, request_type}``.

An inference payload is either Reef's own form ``{"request": {...}, "response": {...}, "dialect"?, "metadata"?}``
or the provider request itself with its ``response`` beside it (``{"model", "messages", ..., "response"}``, the
upstream form). Both are stored as a served exchange is (``route``, ``dialect``, ``request``, ``response``), with
``imported: true``, so a recipe's processor reads an imported exchange exactly as a served one. A payload that
already is a stored exchange (it has a ``route``: ``reef export --format reef-jsonl``) is stored verbatim, so it keeps
its content hash (:mod:`reef_core.observe.stored_form`). The request must hold chat ``messages`` and the response an
assistant message in the dialect. The envelope's optional ``tags`` (a string map), else ``metadata.tags``, become
the record's tags. A report payload follows ``POST /reef/report``'s rules (its references name stored
inference records of the scenario, or inference records earlier in the same batch).

Everything is validated before anything is stored, and a batch is stored in one transaction: on any error (400
naming ``records[i]``, 409 for an id reused with other content, 413 for an envelope over 1 MiB) nothing is stored.
The stored payload depends only on the envelope, so an identical retry returns the same receipts (the store answers
a known id with identical content with the stored record).
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from reef_core.errors import Conflict, PayloadTooLarge, ReefError, ValidationFailed
from reef_core.observe.model import Record, canonical_bytes
from reef_core.names import check_record_id
from reef_core.observe.processors.conversation import UnusableRecord, request_messages, response_message
from reef_core.observe.reports import validate_report
from reef_core.observe.stored_form import check_stored_payload, is_stored_form
from reef_core.serve.routes.batch_body import TRIM_ABOVE_BYTES, give_back_memory, one_batch_at_a_time, parse_batch
from reef_core.serve.routes.inference import read_body, read_json_body
from reef_core.serve.routes.names import RECORD_ID_HEADER, scenario_header

router = APIRouter()

ENVELOPE_FIELDS = frozenset({"agent_record_id", "request_type", "payload"})
OPTIONAL_ENVELOPE_FIELDS = frozenset({"tags"})
REQUEST_TYPES = ("inference", "report")
#: Largest envelope, as canonical JSON (upstream: a record import over 1 MiB is a 413).
MAX_RECORD_BYTES = 1024 * 1024
#: Most envelopes in one batch (the largest batch body is ``server.max_import_body_bytes``).
MAX_BATCH = 1000
#: Keys of Reef's own inference payload form.
OWN_FORM_FIELDS = frozenset({"request", "response", "dialect", "metadata"})
DIALECT_ROUTES = {"openai": "chat", "anthropic": "messages"}


def _inference_payload(payload: dict, where: str) -> tuple[dict, dict]:
    """The stored payload of an imported exchange and its tags; ``where`` prefixes field names in errors."""
    stored = None
    if is_stored_form(payload):
        check_stored_payload(payload, where)
        stored = payload
        request, response, dialect = payload["request"], payload["response"], payload["dialect"]
        metadata = payload.get("metadata")
    elif "request" in payload:
        unknown = sorted(set(payload) - OWN_FORM_FIELDS)
        if unknown:
            raise ValidationFailed(f"{where}: unknown field(s) {', '.join(unknown)}; allowed: "
                                   f"{', '.join(sorted(OWN_FORM_FIELDS))}", param=f"{where}.{unknown[0]}")
        request, response = payload["request"], payload.get("response")
        dialect = payload.get("dialect", "anthropic" if _anthropic_reply(response) else "openai")
        metadata = payload.get("metadata")
    else:  # the upstream form: the provider request, with its response beside it
        request = {k: v for k, v in payload.items() if k not in ("response", "metadata")}
        response = payload.get("response")
        dialect = "anthropic" if _anthropic_reply(response) else "openai"
        metadata = payload.get("metadata")
    if not isinstance(dialect, str) or dialect not in DIALECT_ROUTES:  # an object or a list cannot be looked up
        raise ValidationFailed(f"{where}.dialect must be one of {', '.join(DIALECT_ROUTES)}", param=f"{where}.dialect")
    if not isinstance(request, dict):
        raise ValidationFailed(f"{where}.request must be a JSON object", param=f"{where}.request")
    if not isinstance(request.get("messages"), list) or not request["messages"]:
        raise ValidationFailed(f"{where}: the request needs a non-empty messages list", param=f"{where}.messages")
    if not isinstance(response, dict):
        raise ValidationFailed(f"{where}.response must be a JSON object (the model's answer)",
                               param=f"{where}.response")
    try:
        request_messages(dialect, request)
        response_message(dialect, response)
    except UnusableRecord as exc:
        raise ValidationFailed(f"{where}: {exc}", param=f"{where}.response") from None
    tags = {}
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise ValidationFailed(f"{where}.metadata must be a JSON object", param=f"{where}.metadata")
        tags = _tags(metadata.get("tags") or {}, f"{where}.metadata.tags")
    if stored is None:
        stored = {"route": DIALECT_ROUTES[dialect], "dialect": dialect, "client_dialect": dialect,
                  "request": request, "response": response, "engine": "import", "stream": False, "imported": True}
        if metadata is not None:
            stored["metadata"] = metadata
    return stored, tags


def _tags(tags, where: str) -> dict:
    if not isinstance(tags, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tags.items()):
        raise ValidationFailed(f"{where} must map strings to strings", param=where)
    return tags


def _anthropic_reply(response) -> bool:
    return isinstance(response, dict) and response.get("type") == "message"


def envelope_record(envelope, scenario: str, where: str = "record") -> Record:
    """The record an import envelope describes, or :class:`ValidationFailed` / :class:`PayloadTooLarge` naming
    ``where`` and the field."""
    if not isinstance(envelope, dict):
        raise ValidationFailed(f"{where} must be a JSON object", param=where)
    allowed = ENVELOPE_FIELDS | OPTIONAL_ENVELOPE_FIELDS
    unknown = sorted(set(envelope) - allowed)
    if unknown:
        raise ValidationFailed(f"{where}: unknown field(s) {', '.join(unknown)}; allowed: "
                               f"{', '.join(sorted(allowed))}", param=f"{where}.{unknown[0]}")
    for name in sorted(ENVELOPE_FIELDS):
        if name not in envelope:
            raise ValidationFailed(f"{where}: missing {name}", param=f"{where}.{name}")
    record_id = check_record_id(envelope["agent_record_id"], f"{where}.agent_record_id")
    kind = envelope["request_type"]
    if kind not in REQUEST_TYPES:
        raise ValidationFailed(f"{where}.request_type must be one of {', '.join(REQUEST_TYPES)}",
                               param=f"{where}.request_type")
    payload = envelope["payload"]
    if not isinstance(payload, dict):
        raise ValidationFailed(f"{where}.payload must be a JSON object", param=f"{where}.payload")
    if len(canonical_bytes(envelope)) > MAX_RECORD_BYTES:
        raise PayloadTooLarge(f"{where} is larger than {MAX_RECORD_BYTES} bytes", param=where)
    given_tags = _tags(envelope["tags"], f"{where}.tags") if "tags" in envelope else None
    if kind == "inference":
        stored, tags = _inference_payload(payload, f"{where}.payload")
        return Record(record_id=record_id, scenario=scenario, kind="inference", payload=stored,
                      tags=tags if given_tags is None else given_tags, created_at=time.time())
    if "agent_record_id" in payload:
        raise ValidationFailed(f"{where}.payload.agent_record_id: the envelope names the record",
                               param=f"{where}.payload.agent_record_id")
    try:
        report = validate_report(payload)
    except ValidationFailed as exc:
        raise ValidationFailed(f"{where}.payload: {exc.message}", param=f"{where}.payload") from None
    return Record(record_id=record_id, scenario=scenario, kind="report",
                  payload={k: report[k] for k in ("score", "feedback", "metadata") if k in report},
                  references=report["references"], tags=given_tags or {}, created_at=time.time())


def _receipt(record: Record) -> dict:
    return {"agent_record_id": record.record_id, "scenario": record.scenario, "request_type": record.kind}


async def _store(dep, records: list[Record]) -> list[Record]:
    """Store ``records`` in one transaction; a refusal names the envelope it is about (``records[i]``)."""
    try:
        return await dep.records_stored(records, check_references=True)
    except (Conflict, ValidationFailed) as exc:
        index = _culprit(records, exc)
        if index is None or len(records) == 1:
            raise exc from None
        raise type(exc)(f"records[{index}]: {exc.message}", param=f"records[{index}]", **{
            k: v for k, v in exc.details.items() if k != "param"}) from None


def _culprit(records: list[Record], exc: ReefError) -> int | None:
    """Which record a store refusal is about: the reused id, or the first report quoting the bad reference."""
    record_id, reference = exc.details.get("record_id"), exc.details.get("reference")
    for i, record in enumerate(records):
        if record_id is not None and record.record_id == record_id:
            return i
        if reference is not None and record.kind == "report" and reference in record.references:
            return i
    return None


@router.post("/reef/records")
async def post_record(request: Request):
    dep = request.app.state.reef
    body = await read_json_body(request, MAX_RECORD_BYTES + 4096)
    name = scenario_header(request)
    record = envelope_record(body, name)
    await dep.resolve(name)  # refuses an archived or unknown (implicit scenarios off) one; creates nothing
    stored = (await _store(dep, [record]))[0]
    return JSONResponse(_receipt(stored), headers={RECORD_ID_HEADER: stored.record_id})


@router.post("/reef/records/batch")
async def post_records_batch(request: Request):
    dep = request.app.state.reef
    name = scenario_header(request)
    async with one_batch_at_a_time(request.app.state):  # memory holds one batch, whatever the clients send
        raw = await read_body(request, dep.server.max_import_body_bytes)
        large = len(raw) >= TRIM_ABOVE_BYTES
        try:
            records = parse_batch(raw, MAX_BATCH, lambda envelope, where: envelope_record(envelope, name, where))
            seen: dict[str, int] = {}
            for i, record in enumerate(records):
                first = seen.setdefault(record.record_id, i)
                if first != i and records[first].content_hash != record.content_hash:
                    raise Conflict(f"records[{i}]: agent_record_id {record.record_id!r} is used by records[{first}] "
                                   "with different content", param=f"records[{i}].agent_record_id")
            await dep.resolve(name)
            stored = await _store(dep, records)
            answer = JSONResponse({"records": [_receipt(r) for r in stored]})
        finally:
            del raw
            records = stored = None  # freed before the allocator is asked to give memory back
            if large:
                await asyncio.to_thread(give_back_memory)
    return answer
