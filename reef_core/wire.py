"""The wire: the names the HTTP client and the server share, defined once.

One id, one name: a **record id** names a stored record. On the wire it travels as ``x-reef-agent-record-id`` (the
header) and ``agent_record_id`` (the JSON field: a report's own id, the in-band ``reef`` object of a stream or an
error); a client calls the record id of its own inference its *receipt*, and a report quotes receipts in
``references``.
"""

from __future__ import annotations

#: Every header of Reef's own starts so; none is forwarded to an engine.
HEADER_PREFIX = "x-reef-"
#: The scenario a request belongs to (required on inference, report and train requests).
SCENARIO_HEADER = "x-reef-scenario"
#: The record id of an inference: set by the server on the answer; a client may choose it (a retry with it replays).
RECORD_ID_HEADER = "x-reef-agent-record-id"
#: The harness release that shaped an answer, or that a harness read returns.
RELEASE_HEADER = "x-reef-release-id"
#: A request's pin: an alias (``staging``, ``production``) or a release id of its scenario to serve it instead of the
#: head, where the token may pin (admin or the ``pin`` scope) and the surface can (harness trees).
PIN_HEADER = "x-reef-release"
#: ``x-reef-tag-<name>: <value>`` request headers become the record's tags.
TAG_PREFIX = "x-reef-tag-"
#: Set (``true``) on an answer replayed from a stored record instead of computed again.
REPLAYED_HEADER = "x-reef-replayed"
#: Milliseconds the server added to a plain answer, beyond the engine's own time.
OVERHEAD_HEADER = "x-reef-overhead-ms"
#: How a count_tokens answer was counted by an upstream that has no such route (``estimate`` or ``probe``).
TOKEN_COUNT_HEADER = "x-reef-token-count"
#: The standard retry key a client may send; a repeat of the same request replays its record.
IDEMPOTENCY_HEADER = "idempotency-key"

#: The in-band object of a stream's last event (and of an error event): ``{"reef": {"agent_record_id": ...}}``.
ENVELOPE_FIELD = "reef"
#: The record id's field name in JSON bodies.
RECORD_ID_FIELD = "agent_record_id"

#: The inference routes: path -> (the client's dialect, the route).
INFERENCE_ROUTES: dict[str, tuple[str, str]] = {
    "/v1/chat/completions": ("openai", "chat"),
    "/v1/messages": ("anthropic", "messages"),
    "/v1/messages/count_tokens": ("anthropic", "count_tokens"),
    "/v1/responses": ("openai", "responses"),
}
#: The path of each route (an engine's upstream uses the same ones).
ROUTE_PATHS: dict[str, str] = {route: path for path, (_dialect, route) in INFERENCE_ROUTES.items()}
