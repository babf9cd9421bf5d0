"""One inference request in the loop's terms: what ``serve/routes/inference.py`` asks between the door and the reply.

The route reads and validates the HTTP request, then asks here (through the deployment, ``ServePorts``):

* :func:`find_retry`: does the request repeat an earlier one? A complete earlier record is replayed; an incomplete
  one makes this request a retry of it (``payload.retry_of``);
* :func:`plan`: the scenario's creation when its recipe serves a seed release, how its surface shapes the request
  (a harness's system prompt), the translation to the engine's dialect and the version frozen for it: an
  :class:`EngineRequest` and what the answer carries;
* :meth:`Exchange.record`: the :class:`Record` stored for it, however the answer ended.

Nothing here knows HTTP: the route turns what comes back into responses, streams and receipts.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..engines.base import EngineRequest, TokenData
from ..engines.translate import translate_request
from ..errors import Conflict
from ..observe.model import Record
from ..surfaces.composite import kinds_of


def new_record_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Retry:
    """What the retry lookup found: a complete record to ``replay``, or the attempt this request repeats."""

    replay: Record | None = None
    #: The latest incomplete attempt of the same request, named in the new record's ``payload.retry_of``.
    retry_of: str | None = None
    #: The id the new record takes (a fresh one when the client's id names an incomplete attempt).
    record_id: str | None = None


def find_retry(dep, scenario: str, request_hash: str, record_id: str, *, client_record_id: str | None,
               idempotency_key: str | None, sdk_retry: bool) -> Retry:
    """Whether the request repeats an earlier one (blocking reads: run it on a worker thread).

    A request repeats an earlier one when it carries a record id or an ``Idempotency-Key`` already used in the
    scenario (for another request: :class:`Conflict`), or is an SDK retry of the same body. Only a complete
    record is replayed: when every earlier attempt is incomplete, the request runs again and its record names
    the latest attempt in ``retry_of`` (the store then points the key at it). Record ids are scoped per scenario:
    another scenario's record of the same id is another record, never a conflict.
    """
    attempts: list[Record] = []
    if client_record_id:
        found = dep.find_record(scenario, client_record_id)
        if found is not None:
            if found.request_hash != request_hash:
                raise Conflict(f"record id {client_record_id!r} was already used for another request")
            if found.complete:
                return Retry(replay=found)
            attempts.append(found)
    keyed = None
    if idempotency_key:
        keyed = dep.find_by_idempotency_key(scenario, idempotency_key)
        if keyed is not None:
            if keyed.request_hash != request_hash:
                raise Conflict(f"Idempotency-Key {idempotency_key!r} was already used for another request")
            if keyed.complete:
                return Retry(replay=keyed)
            attempts.append(keyed)
    # A key follows its latest attempt; a record id or an SDK retry only says "this body again": its latest
    # attempt is the newest record of the same request (a complete retry of a cut attempt, or the attempt).
    if keyed is None and (attempts or sdk_retry):
        found = dep.find_recent_by_request_hash(scenario, request_hash)
        if found is not None:
            if found.complete:
                return Retry(replay=found)
            attempts.append(found)
    if not attempts:
        return Retry(record_id=record_id)
    latest = max(attempts, key=lambda record: record.sequence or 0)
    if any(attempt.record_id == record_id for attempt in attempts):
        record_id = new_record_id()  # the client's id names the incomplete attempt
    return Retry(retry_of=latest.record_id, record_id=record_id)


@dataclass
class Plan:
    """How the engine is asked: the request in its dialect, and what the answer carries besides."""

    scenario: Any
    engine_dialect: str
    engine_request: EngineRequest
    #: The harness release that shaped the request (None when no surface did).
    release_id: str | None = None
    #: Headers the surface adds to the answer (the release id).
    response_headers: dict[str, str] = field(default_factory=dict)
    #: The ``x-reef-release`` value that pinned a release other than the head (kept in the record).
    pinned: str | None = None
    #: The rollout's assignment of this request (``payload.rollout``: strategy, arm, the canary or the arm's release).
    rollout: dict | None = None


async def plan(dep, scenario, client_dialect: str, route: str, body: dict, forward_headers: dict[str, str],
               max_new_tokens: int, pin: str | None = None, tags: dict | None = None,
               record_id: str | None = None) -> Plan:
    """The engine request for a validated ``body`` of ``scenario`` (resolved, not necessarily stored yet);
    ``pin`` (``x-reef-release``) names the release to serve instead of the head, resolved before anything is
    created. Without a pin, a rollout (canary or A/B, :mod:`reef_core.loop.rollout`) may assign the request to
    another release by its sticky key (``tags``, else ``record_id``)."""
    pinned = await asyncio.to_thread(dep.pinned_release, scenario, pin) if pin is not None else None
    engine = dep.engine
    engine_dialect = client_dialect if client_dialect in engine.dialects else engine.dialects[0]
    engine_route = route if engine_dialect == client_dialect else (
        "chat" if engine_dialect == "openai" else "messages")
    if not dep.is_active(scenario.name) and dep.serves_a_seed(scenario):
        # The recipe serves its first request from a seed release (a harness trainer's initial files): create
        # the scenario now, once the whole request, body included, has passed the door.
        scenario = await dep.create_scenario(scenario.name)
    # A harness surface may shape the request (e.g. the current system prompt). A scenario not stored yet has
    # no release to serve, and asking its surface would leave state behind for a request that may be refused.
    recipe_surface = dep.surface_for(scenario)
    surface = recipe_surface if dep.is_active(scenario.name) else None
    release_id, headers, assigned = None, {}, None
    if surface is not None and route != "count_tokens" and pin is None and dep.rolls_out(scenario):
        pinned, assigned = await asyncio.to_thread(dep.rollout_plan, scenario, tags, record_id or new_record_id())
    if surface is not None and route != "count_tokens":
        if pinned is not None:  # a pinnable (harness) surface shapes this one request with the pinned release
            body, release_id = surface.prepare_pinned(scenario.name, client_dialect, body, pinned)
        else:
            body, release_id = surface.prepare_request(scenario.name, client_dialect, body)
        headers = surface.response_headers(scenario.name, release_id)
    upstream_body = translate_request(body, client_dialect, engine_dialect, max_new_tokens)
    # Token data is what a weights recipe trains on; other scenarios may take an engine's plain route.
    trains_weights = "weights" in kinds_of(recipe_surface)
    request = EngineRequest(dialect=engine_dialect, route=engine_route, body=upstream_body, headers=forward_headers,
                            version=pinned or dep.serving_version(scenario), tokens=trains_weights)
    return Plan(scenario=scenario, engine_dialect=engine_dialect, engine_request=request, release_id=release_id,
                response_headers=headers, pinned=pin if pin is not None and pinned is not None else None,
                rollout=assigned)


@dataclass
class Exchange:
    """What every record of one request shares; :meth:`record` adds how the answer ended."""

    record_id: str
    scenario: str
    client_dialect: str
    plan: Plan
    engine_name: str
    tags: dict[str, str]
    request_hash: str
    created_at: float
    retry_of: str | None = None
    #: The Responses API request's entry (``payload.responses``) when the request came as one.
    responses_entry: dict | None = None

    def record(self, *, response: Any, tokens: TokenData | None, version: str | None, engine_ms: float,
               total_ms: float, complete: bool, error: str | None = None, stream: bool = False) -> Record:
        req = self.plan.engine_request
        payload: dict[str, Any] = {
            "route": req.route,
            "dialect": self.plan.engine_dialect,
            "client_dialect": self.client_dialect,
            "request": req.body,
            "response": response,
            "engine": self.engine_name,
            "stream": stream,
            "timings": {"engine_ms": round(engine_ms, 3), "total_ms": round(total_ms, 3)},
        }
        if tokens is not None:
            payload["tokens"] = tokens.to_dict()
        if error:
            payload["error"] = error
        if self.plan.release_id:
            payload["release_id"] = self.plan.release_id  # the harness release that shaped the request
        if self.plan.pinned:
            payload["pinned"] = self.plan.pinned  # the alias (or id) that chose the release, not the head
        if self.plan.rollout:
            payload["rollout"] = self.plan.rollout  # which side of a canary or which A/B arm served it
        if self.retry_of:
            payload["retry_of"] = self.retry_of  # the incomplete attempt this request repeats
        if self.responses_entry is not None:
            payload["responses"] = self.responses_entry
        top_k = tokens.packed_top_k() if tokens is not None else None
        return Record(record_id=self.record_id, scenario=self.scenario, kind="inference", payload=payload,
                      tags=self.tags, version=(tokens.version if tokens else None) or version or req.version,
                      complete=complete, request_hash=self.request_hash, created_at=self.created_at, top_k=top_k)
