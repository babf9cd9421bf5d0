"""What a compacted record looks like: its payload replaced by a stub that keeps the metadata.

Retention (:mod:`reef_core.observe.compaction`) drops an inference record's bodies (request, response, token ids
and log-probs, the Responses entry, the packed top-K column) and keeps everything else of the row: id (the receipt),
kind, sequence, created_at, version, tags, references, request and content hashes. The stub keeps the payload's
small metadata (route, dialects, engine, timings, error, release, pin, retry_of), the usage the engine reported and
the token counts, under the marker :data:`MARKER` ``{"at", "reason", "body_bytes"}``. The stored content hash is
the hash of the original body, so a client re-sending the same record is still recognised as identical.
"""

from __future__ import annotations

from typing import Any

from reef_core.observe.model import Record

#: The payload key of the stub: ``{"at": unix seconds, "reason": consumed | expired | max_bytes, "body_bytes": n}``.
MARKER = "reef_compacted"
REASONS = ("consumed", "expired", "max_bytes")
#: Payload keys kept beside the marker (all small, none a body).
KEPT = ("route", "dialect", "client_dialect", "engine", "stream", "timings", "error", "release_id", "pinned",
        "retry_of", "rollout")


def compaction_of(record: Record) -> dict | None:
    """The marker of a compacted record (``{"at", "reason", "body_bytes"}``), or ``None`` for a whole one."""
    found = record.payload.get(MARKER) if isinstance(record.payload, dict) else None
    return found if isinstance(found, dict) and "at" in found and "reason" in found else None


def is_compacted(record: Record) -> bool:
    return compaction_of(record) is not None


def token_counts(payload: dict) -> dict[str, int]:
    """Prompt and output token counts of a payload's token data and the usage the engine reported."""
    counts: dict[str, int] = {}
    tokens = payload.get("tokens")
    if isinstance(tokens, dict):
        for name, key in (("prompt_ids", "prompt_tokens"), ("output_ids", "output_tokens")):
            if isinstance(tokens.get(name), list):
                counts[key] = len(tokens[name])
    return counts


def stub_payload(payload: dict, *, at: float, reason: str, body_bytes: int) -> dict[str, Any]:
    """The payload a compacted record keeps (see the module docstring)."""
    stub: dict[str, Any] = {MARKER: {"at": at, "reason": reason, "body_bytes": body_bytes}}
    stub.update({k: payload[k] for k in KEPT if k in payload})
    response = payload.get("response")
    if isinstance(response, dict):
        if isinstance(response.get("usage"), dict):
            stub["usage"] = response["usage"]
        if isinstance(response.get("model"), str):
            stub["model"] = response["model"]
    counts = token_counts(payload)
    if counts:
        stub["token_counts"] = counts
    return stub
