"""The stored form of an inference payload, as ``reef export --format reef-jsonl`` writes it and the record import
takes it back verbatim, so that a record keeps its content hash across deployments (the hash covers the payload:
:func:`reef_core.observe.model.compute_content_hash`).

A payload with a ``route`` is in this form: the fields a served (or imported) exchange is stored with
(``reef_core.loop.inference.Exchange.record``: a field added there is added to :data:`FIELDS` here, or its records
no longer import), each checked for its type here; its request and response are checked
by the import as every imported exchange's are. Token data is checked for shape (what a weights trainer reads).
"""

from __future__ import annotations

import math
from typing import Any

from reef_core.errors import ValidationFailed
from reef_core.names import check_record_id

#: route -> the dialect its bodies are in (only chat exchanges are exported).
ROUTE_DIALECTS = {"chat": "openai", "messages": "anthropic"}
DIALECTS = ("openai", "anthropic")
REQUIRED = ("route", "dialect", "request", "response")
_TEXT = ("engine", "error", "release_id", "pinned")
_OBJECTS = ("metadata", "responses", "rollout")
FIELDS = frozenset({*REQUIRED, *_TEXT, *_OBJECTS, "client_dialect", "stream", "timings", "tokens", "retry_of",
                    "imported"})
_LONGEST_TEXT = 4096


def is_stored_form(payload: dict) -> bool:
    return "route" in payload


def check_stored_payload(payload: dict, where: str) -> None:
    """Refuse (:class:`ValidationFailed` naming ``where.<field>``) a stored-form payload with an unknown, missing
    or mistyped field."""
    unknown = sorted(set(payload) - FIELDS)
    if unknown:
        raise ValidationFailed(f"{where}: unknown field(s) {', '.join(unknown)} of a stored exchange; allowed: "
                               f"{', '.join(sorted(FIELDS))}", param=f"{where}.{unknown[0]}")
    for name in REQUIRED:
        if name not in payload:
            raise ValidationFailed(f"{where}: a stored exchange needs {name}", param=f"{where}.{name}")
    route = payload["route"]
    if not isinstance(route, str) or route not in ROUTE_DIALECTS:
        raise ValidationFailed(f"{where}.route must be one of {', '.join(ROUTE_DIALECTS)}", param=f"{where}.route")
    if payload["dialect"] != ROUTE_DIALECTS[route]:
        raise ValidationFailed(f"{where}.dialect must be {ROUTE_DIALECTS[route]!r} for route {route!r}",
                               param=f"{where}.dialect")
    if payload.get("client_dialect", "openai") not in DIALECTS:
        raise ValidationFailed(f"{where}.client_dialect must be one of {', '.join(DIALECTS)}",
                               param=f"{where}.client_dialect")
    for name in _TEXT:
        value = payload.get(name)
        if value is not None and not (isinstance(value, str) and len(value) <= _LONGEST_TEXT):
            raise ValidationFailed(f"{where}.{name} must be text of at most {_LONGEST_TEXT} characters",
                                   param=f"{where}.{name}")
    for name in _OBJECTS:
        if name in payload and not isinstance(payload[name], dict):
            raise ValidationFailed(f"{where}.{name} must be a JSON object", param=f"{where}.{name}")
    if "stream" in payload and not isinstance(payload["stream"], bool):
        raise ValidationFailed(f"{where}.stream must be a boolean", param=f"{where}.stream")
    if "imported" in payload and payload["imported"] is not True:
        raise ValidationFailed(f"{where}.imported can only be true", param=f"{where}.imported")
    if payload.get("retry_of") is not None:
        check_record_id(payload["retry_of"], f"{where}.retry_of")
    _check_timings(payload.get("timings"), f"{where}.timings")
    _check_tokens(payload.get("tokens"), f"{where}.tokens")


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _check_timings(timings: Any, where: str) -> None:
    if timings is None:
        return
    if not isinstance(timings, dict) or not all(isinstance(k, str) and _finite(v) for k, v in timings.items()):
        raise ValidationFailed(f"{where} must map names to finite numbers", param=where)


def _check_tokens(tokens: Any, where: str) -> None:
    """Token data as the engines store it (``TokenData.to_dict``): id lists, one log-prob per output id."""
    if tokens is None:
        return
    if not isinstance(tokens, dict) or set(tokens) - {"prompt_ids", "output_ids", "output_logprobs", "version"}:
        raise ValidationFailed(f"{where} must be {{prompt_ids, output_ids, output_logprobs, version}}", param=where)
    for name in ("prompt_ids", "output_ids"):
        ids = tokens.get(name)
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**31
                                                for i in ids):
            raise ValidationFailed(f"{where}.{name} must be a list of token ids", param=f"{where}.{name}")
    logprobs = tokens.get("output_logprobs")
    if not isinstance(logprobs, list) or len(logprobs) != len(tokens["output_ids"]) or not all(
            _finite(x) for x in logprobs):
        raise ValidationFailed(f"{where}.output_logprobs must hold one finite log-probability per output id",
                               param=f"{where}.output_logprobs")
    version = tokens.get("version")
    if version is not None and not (isinstance(version, str) and len(version) <= _LONGEST_TEXT):
        raise ValidationFailed(f"{where}.version must be text", param=f"{where}.version")
