"""``GET /reef/scenarios/{s}/export``: a scenario's records as a dataset, streamed as NDJSON (``read`` scope).

The lines are ``reef export``'s (:mod:`reef_core.loop.export`): ``openai-jsonl`` (OpenAI fine-tuning lines, the
default) or ``reef-jsonl`` (import envelopes that ``POST /reef/records/batch`` stores again with the same content
hashes). ``hf`` and ``parquet`` are files only the CLI writes (a 400 naming ``format`` here). Every parameter is
checked before the first byte is sent; the records are then read from the store a page at a time on a worker
thread, so the server holds one chunk of lines, not the export.
"""

from __future__ import annotations

import asyncio
import itertools

from fastapi import APIRouter, Query, Request
from starlette.responses import StreamingResponse

from reef_core.errors import ValidationFailed
from reef_core.loop.export import FORMATS, LINE_FORMATS, check_format, json_line
from reef_core.serve.routes.names import path_scenario

router = APIRouter()
#: Lines read from the store per trip to the worker thread (one chunk of the response).
CHUNK_LINES = 200
_HEADERS = {"cache-control": "no-store"}


@router.get("/reef/scenarios/{scenario}/export",
            responses={200: {"content": {"application/x-ndjson": {"schema": {"type": "string"}}},
                             "description": "one JSON object a line"}})
async def export_records(
        request: Request, scenario: str,
        format: str = Query("openai-jsonl", max_length=40, description="openai-jsonl or reef-jsonl (hf and "
                                                                        "parquet: reef export on the command line)"),
        since: str | None = Query(None, max_length=64, description="an ISO-8601 time (records created from it on) "
                                                                   "or a record sequence (records after it)"),
        release: str | None = Query(None, max_length=64, description="only records this release served (its id or "
                                                                     "a unique prefix of 7+ hex digits)"),
        scored_only: bool = Query(False, description="only records a report gave a score")):
    """The scenario's complete chat exchanges (and, in reef-jsonl, its reports), oldest first."""
    if format in FORMATS and format not in LINE_FORMATS:
        raise ValidationFailed(f"format {format!r} is a file written by the command line (reef export --format "
                               f"{format}); this route streams {' or '.join(LINE_FORMATS)}", param="format")
    check_format(format, "format", LINE_FORMATS)
    dep = request.app.state.reef
    found = await path_scenario(dep, scenario, archived=True)
    rows = await asyncio.to_thread(dep.export_rows, found, format, since=since, release=release,
                                   scored_only=scored_only)
    return StreamingResponse(_chunks(iter(rows)), media_type="application/x-ndjson", headers=_HEADERS)


async def _chunks(rows):
    while True:
        chunk = await asyncio.to_thread(_take, rows)
        if not chunk:
            return
        yield chunk


def _take(rows) -> bytes:
    return "".join(json_line(row) for row in itertools.islice(rows, CHUNK_LINES)).encode("utf-8")
