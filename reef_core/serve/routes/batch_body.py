"""The body of ``POST /reef/records/batch``, parsed one envelope at a time, with its memory bounded.

A batch may hold tens of megabytes (``server.max_import_body_bytes``). Parsed whole, it would be held four times at
once: the chunks, their join, the text and the parsed tree, beside the records built from it. Here:

* the bytes are read into one buffer (:func:`~reef_core.serve.routes.inference.read_body`), released as soon as
  it is decoded;
* the ``records`` array is walked with the C decoder's ``raw_decode``, one envelope at a time, and each envelope
  becomes its record (``build``) before the next is parsed, so the whole tree never exists;
* each envelope gets the checks every body gets (:mod:`~reef_core.serve.routes.jsonbody`: nesting depth, ``NaN``,
  lone surrogates), named ``records[i]``;
* batches are parsed and stored one at a time per server (:func:`one_batch_at_a_time`): concurrent batches wait
  before reading their bodies, so memory holds one batch, not one per client;
* afterwards the C allocator is asked to give freed memory back to the system (glibc's ``malloc_trim``), so a large
  import does not leave the process holding its peak.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import json
import logging
import re
from typing import Any, Callable

from reef_core.errors import ValidationFailed
from reef_core.serve.routes.jsonbody import _DECODER, _SURROGATE_ESCAPE, MAX_DEPTH, lone_surrogate_at, nesting_depth

log = logging.getLogger("reef.serve.imports")

_WS = re.compile(r"[ \t\n\r]*")
_INVALID = "request body is not valid JSON"
#: A body at least this large is followed by a ``malloc_trim``.
TRIM_ABOVE_BYTES = 8 * 1024 * 1024


def parse_batch(raw: bytearray, max_records: int, build: Callable[[Any, str], Any]) -> list:
    """``build(envelope, "records[i]")`` for each envelope of ``{"records": [...]}`` in ``raw`` (cleared once
    decoded), in order; :class:`ValidationFailed` naming the field for anything else."""
    try:
        encoding = json.detect_encoding(raw)
        text = raw.decode(encoding, "surrogatepass")
    except UnicodeDecodeError:
        raise ValidationFailed(_INVALID) from None
    # Surrogates come from an escape or (in UTF-8) a 0xED lead byte: without either, no envelope is walked for them.
    surrogates = _SURROGATE_ESCAPE.search(text) is not None or (
        b"\xed" in raw if encoding.startswith("utf-8") else True)
    raw.clear()
    pos = _skip(text, 0)
    if not text.startswith("{", pos):
        _refuse_whole(text)
    built: list | None = None
    pos = _skip(text, pos + 1)
    if text.startswith("}", pos):
        pos += 1
    else:
        while True:
            if not text.startswith('"', pos):
                raise ValidationFailed(_INVALID)
            key, pos = _decode(text, pos)
            pos = _skip(text, pos)
            if not text.startswith(":", pos):
                raise ValidationFailed(_INVALID)
            pos = _skip(text, pos + 1)
            if key != "records":
                raise ValidationFailed(f"unknown field(s) {key}; allowed: records", param=key)
            if built is not None:
                raise ValidationFailed("records is given twice", param="records")
            if not text.startswith("[", pos):
                _decode(text, pos)  # a malformed value is invalid JSON; a well-formed one is not a list
                raise ValidationFailed(f"records must be a list of 1 to {max_records} envelopes", param="records")
            built, pos = _walk(text, pos, max_records, build, surrogates)
            pos = _skip(text, pos)
            if text.startswith(",", pos):
                pos = _skip(text, pos + 1)
                continue
            if not text.startswith("}", pos):
                raise ValidationFailed(_INVALID)
            pos += 1
            break
    if _skip(text, pos) != len(text):
        raise ValidationFailed(_INVALID)
    if not built:
        raise ValidationFailed(f"records must be a list of 1 to {max_records} envelopes", param="records")
    return built


def _walk(text: str, pos: int, max_records: int, build, surrogates: bool) -> tuple[list, int]:
    out: list = []
    pos = _skip(text, pos + 1)
    if text.startswith("]", pos):
        return out, pos + 1
    while True:
        if len(out) == max_records:
            raise ValidationFailed(f"records must be a list of 1 to {max_records} envelopes", param="records")
        where = f"records[{len(out)}]"
        start = pos
        envelope, pos = _decode(text, pos)
        limit = MAX_DEPTH - 2  # the body object and the array are the first two levels
        if isinstance(envelope, (dict, list)) and (text.count("[", start, pos) + text.count("{", start, pos) > limit
                                                   and nesting_depth(envelope, limit) > limit):
            raise ValidationFailed(f"request body is nested deeper than {MAX_DEPTH} levels")
        if surrogates:
            at = lone_surrogate_at(envelope)
            if at is not None:
                where_at = where if at == "body" else f"{where}.{at}"
                raise ValidationFailed(f"{where_at}: holds a lone surrogate (an unpaired \\ud800-\\udfff escape), "
                                       "which is not Unicode text", param=where_at)
        out.append(build(envelope, where))
        del envelope
        pos = _skip(text, pos)
        if text.startswith(",", pos):
            pos = _skip(text, pos + 1)
            continue
        if text.startswith("]", pos):
            return out, pos + 1
        raise ValidationFailed(_INVALID)


def _decode(text: str, pos: int) -> tuple[Any, int]:
    try:
        return _DECODER.raw_decode(text, pos)
    except RecursionError:
        raise ValidationFailed(f"request body is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError:  # malformed JSON, or an integer beyond Python's digit limit
        raise ValidationFailed(_INVALID) from None


def _skip(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()


def _refuse_whole(text: str) -> None:
    """A body that is not an object: invalid JSON, or JSON of another kind (as the whole-body parser says)."""
    try:
        _DECODER.decode(text)
    except RecursionError:
        raise ValidationFailed(f"request body is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError:
        raise ValidationFailed(_INVALID) from None
    raise ValidationFailed("request body must be a JSON object")


@contextlib.asynccontextmanager
async def one_batch_at_a_time(state):
    """Hold the server's batch slot (one per app: ``state`` is ``app.state``)."""
    lock = getattr(state, "batch_import_lock", None)
    if lock is None:
        lock = state.batch_import_lock = asyncio.Lock()
    async with lock:
        yield


def give_back_memory() -> None:
    """Return the allocator's free memory to the system (glibc only; elsewhere nothing happens)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim") if name else None
    except (OSError, AttributeError):
        return None
