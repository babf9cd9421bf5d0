"""``ReefClient`` and ``AsyncReefClient``: one scenario's view of a Reef server.

Both share every rule (:class:`_Base`) and differ only in how a request is sent. Reef's own routes are retried on
429, 5xx and connection errors with exponential backoff (honouring ``Retry-After``); a report is retry-safe because
it always carries a client-chosen ``agent_record_id``: a repeated attempt the server already stored returns the stored
report instead of a second one. Inference goes through the provider SDKs (``openai()``, ``anthropic()``), whose own
retries the server recognises as repeats.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable
from urllib.parse import quote

import httpx

from .capture import Receipt, ReceiptLog, SCENARIO_HEADER, TAG_PREFIX, capture_client
from .errors import RateLimited, Unreachable, error_for
from .imports import DEFAULT_BATCH, batches, line_envelopes
from .tree import write_tree

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class _Call:
    method: str
    path: str
    params: dict | None = None
    json: Any = None
    scenario_header: bool = True


def _check_tag(name: str) -> str:
    if not name or not all(c.isalnum() or c in "-_" for c in name):
        raise ValueError(f"tag name {name!r} must be letters, digits, '-' or '_'")
    return name.lower()


class _Base:
    def __init__(self, url: str | None = None, *, scenario: str | None = None, token: str | None = None,
                 tags: dict[str, str] | None = None, timeout: float = 60.0, retries: int = 4,
                 backoff_s: float = 0.25):
        url = url or os.environ.get("REEF_URL")
        if not url:
            raise ValueError("no Reef URL: pass url= or set REEF_URL")
        # Only the deployment-wide routes (server_status) work without a scenario.
        scenario = scenario or os.environ.get("REEF_SCENARIO") or None
        if retries < 0:
            raise ValueError("retries must be >= 0")
        self.url = url.rstrip("/")
        self.scenario = scenario
        self.token = token if token is not None else os.environ.get("REEF_TOKEN")
        self.tags = {_check_tag(k): str(v) for k, v in (tags or {}).items()}
        self.timeout = timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.receipts = ReceiptLog()

    # -- headers ------------------------------------------------------------------------------------------------

    def headers(self, *, scenario: bool = True) -> dict[str, str]:
        """Headers of every request: the token, and the scenario (as UTF-8 bytes, the way Reef reads it)."""
        out = {}
        if self.token:
            out["authorization"] = f"Bearer {self.token}"
        if scenario:
            out[SCENARIO_HEADER] = self._need_scenario()
        return out

    def _need_scenario(self) -> str:
        if not self.scenario:
            raise ValueError("no scenario: pass scenario= or set REEF_SCENARIO")
        return self.scenario

    def inference_headers(self) -> dict[str, str]:
        return {**self.headers(), **{f"{TAG_PREFIX}{k}": v for k, v in self.tags.items()}}

    def _scenario_path(self, suffix: str) -> str:
        return f"/reef/scenarios/{quote(self._need_scenario(), safe='')}/{suffix}"

    # -- references ---------------------------------------------------------------------------------------------

    def _references(self, references) -> tuple[list[str], int | None]:
        """The receipt ids a report quotes, and (for ``"session"``) the log position the report closes."""
        if references is None:
            return [], None
        if references == "last":
            last = self.receipts.last()
            if last is None:
                raise ValueError('references="last": no receipt was captured yet')
            return [last.record_id], None
        if references == "session":
            return [r.record_id for r in self.receipts.session()], len(self.receipts)
        if isinstance(references, (str, Receipt)):
            references = [references]
        return [r.record_id if isinstance(r, Receipt) else str(r) for r in references], None

    def _report_call(self, score, feedback, references, metadata, report_id) -> tuple[_Call, int | None]:
        refs, closes = self._references(references)
        body: dict[str, Any] = {"references": refs, "agent_record_id": report_id or f"rpt-{uuid.uuid4().hex}"}
        if score is not None:
            body["score"] = score
        if feedback is not None:
            body["feedback"] = feedback
        if metadata is not None:
            body["metadata"] = metadata
        return _Call("POST", "/reef/report", json=body), closes

    # -- retries ------------------------------------------------------------------------------------------------

    def _delay(self, attempt: int, response: httpx.Response | None) -> float:
        retry_after = response.headers.get("retry-after") if response is not None else None
        if retry_after:
            try:
                return min(float(retry_after), 30.0)
            except ValueError:
                pass
        return self.backoff_s * (2 ** attempt) * (0.5 + random.random() / 2)

    @staticmethod
    def _outcome(response: httpx.Response) -> Any:
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code >= 400:
            error = error_for(response.status_code, body, response.text[:500] or response.reason_phrase)
            if isinstance(error, RateLimited):
                error.retry_after = _seconds(response.headers.get("retry-after"))
            raise error
        return body

    def _request_kwargs(self, call: _Call) -> dict:
        return {"params": call.params, "json": call.json, "headers": self.headers(scenario=call.scenario_header)}


#: A 429 that asks for a longer wait than this (a spent token budget: until the period ends, or never) is raised at
#: once as :class:`RateLimited` with its ``retry_after``, not slept on.
MAX_RETRY_AFTER_S = 30.0


def _worth_retrying(response: httpx.Response) -> bool:
    if response.status_code != 429:
        return True
    retry_after = response.headers.get("retry-after")
    try:
        return retry_after is not None and float(retry_after) <= MAX_RETRY_AFTER_S
    except ValueError:
        return False


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


class ReefClient(_Base):
    """A synchronous client of one scenario. ``ReefClient(url, scenario=..., token=..., tags=...)``; ``url``,
    ``scenario`` and ``token`` default to ``REEF_URL``, ``REEF_SCENARIO`` and ``REEF_TOKEN``."""

    def __init__(self, url: str | None = None, *, transport: httpx.BaseTransport | None = None, **kwargs):
        super().__init__(url, **kwargs)
        self._http = httpx.Client(base_url=self.url, timeout=self.timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "ReefClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, call: _Call) -> Any:
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                response = self._http.request(call.method, call.path, **self._request_kwargs(call))
            except httpx.TransportError as exc:
                if last:
                    raise Unreachable(f"{self.url}: {exc}") from exc
                time.sleep(self._delay(attempt, None))
                continue
            if response.status_code in RETRY_STATUSES and not last and _worth_retrying(response):
                time.sleep(self._delay(attempt, response))
                continue
            return self._outcome(response)

    # -- provider SDKs ------------------------------------------------------------------------------------------

    def http_client(self, module=httpx):
        """A ``module.Client`` (``httpx`` or an SDK's fork of it) that adds the scenario, tags and token and captures
        receipts into this client."""
        return capture_client(module, self.scenario, self.inference_headers(), self.receipts, timeout=self.timeout)

    def openai(self, client=None, **kwargs):
        """An ``openai.OpenAI`` pointed at Reef (or ``client`` copied with Reef's transport)."""
        import openai

        if client is not None:
            return client.with_options(http_client=self.http_client())
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.token or "reef",
                             http_client=self.http_client(), **kwargs)

    def anthropic(self, client=None, **kwargs):
        """An ``anthropic.Anthropic`` pointed at Reef (or ``client`` copied with Reef's transport)."""
        import anthropic

        module = _sdk_http(anthropic)
        if client is not None:
            return client.with_options(http_client=self.http_client(module))
        return anthropic.Anthropic(base_url=self.url, api_key=self.token or "reef",
                                   http_client=self.http_client(module), **kwargs)

    # -- Reef routes --------------------------------------------------------------------------------------------

    def report(self, *, score: float | None = None, feedback: Any = None, references: Any = "last",
               metadata: dict | None = None, report_id: str | None = None) -> dict:
        """Send a report quoting ``references``: ``"last"`` (the newest receipt), ``"session"`` (every receipt
        since the last session report), receipts or ids, or None. Returns ``{agent_record_id, scenario, ...}``."""
        call, closes = self._report_call(score, feedback, references, metadata, report_id)
        answer = self._run(call)
        if closes is not None:
            self.receipts.close_session(closes)
        return answer

    def import_records(self, items: Iterable[Any], *, batch_size: int = DEFAULT_BATCH,
                       progress: Callable[[int], None] | None = None) -> list[dict]:
        """Import records without calling a model (``POST /reef/records/batch``): each item a Reef envelope
        ``{agent_record_id, request_type, payload}`` or an OpenAI-style conversation ``{"messages": [...],
        "score": ...}`` (:mod:`reef_core.client.imports`). Sent ``batch_size`` envelopes a request, each stored in
        one transaction or not at all (a refused request raises, naming ``records[i]`` of that request; the
        requests before it stay stored, and importing again is safe: identical records keep their receipts).
        ``progress(n)`` hears how many envelopes each stored request held. Returns the receipts in order."""
        receipts: list[dict] = []
        scenario = self._need_scenario()
        groups = (line_envelopes(item, scenario, f"item {i}") for i, item in enumerate(items))
        for batch in batches(groups, batch_size):
            answer = self._run(_Call("POST", "/reef/records/batch", json={"records": batch}))
            receipts.extend(answer["records"])
            if progress is not None:
                progress(len(batch))
        return receipts

    def records(self, *, after_sequence: int = 0, limit: int | None = None) -> list[dict]:
        """The scenario's records, oldest first (all of them, or the first ``limit``)."""
        rows: list[dict] = []
        cursor = after_sequence
        while limit is None or len(rows) < limit:
            page = self._run(_Call("GET", self._scenario_path("records"),
                                   params={"after_sequence": cursor, "limit": 100}, scenario_header=False))
            rows.extend(page["records"])
            if page.get("next_after_sequence") is None:
                break
            cursor = page["next_after_sequence"]
        return rows if limit is None else rows[:limit]

    def record(self, record_id: str) -> dict:
        return self._run(_Call("GET", self._scenario_path(f"records/{quote(record_id, safe='')}"),
                               scenario_header=False))

    def releases(self) -> list[dict]:
        """The scenario's releases, oldest first (``current`` marks the one serving)."""
        return self._run(_Call("GET", self._scenario_path("releases"), scenario_header=False))["releases"]

    def commits(self, *, after_step: int = 0, limit: int = 50) -> list[dict]:
        """Commit-log rows of the scenario after ``after_step`` (what each learner step decided)."""
        return self._run(_Call("GET", self._scenario_path("commits"), params={"after_step": after_step,
                                                                            "limit": limit},
                               scenario_header=False))["commits"]

    def status(self) -> dict:
        """The scenario's learner status (queue, step, serving release, last error)."""
        return self._run(_Call("GET", self._scenario_path("status"), scenario_header=False))

    def server_status(self) -> dict:
        """The deployment's status: every scenario's learner and the engine."""
        return self._run(_Call("GET", "/reef/status", scenario_header=False))

    def harness(self, directory: str | os.PathLike | None = None, *, release_id: str | None = None) -> dict:
        """The harness tree (``{release_id, content_id, files, ...}``); with ``directory``, also written there
        with its sidecar (files the previous pull listed and this release lacks are deleted)."""
        params = {"release_id": release_id} if release_id else None
        tree = self._run(_Call("GET", "/reef/harness", params=params))
        if directory is not None:
            tree["written"] = write_tree(directory, tree["release_id"], tree.get("content_id"), tree["files"])
        return tree

    def wait_for_release(self, after: str | None, *, timeout: float = 300.0, interval: float = 0.5) -> dict:
        """Poll until the scenario serves a release other than ``after``; return its row."""
        deadline = time.monotonic() + timeout
        while True:
            current = _current(self.releases())
            if current is not None and current.get("release_id") != after:
                return current
            if time.monotonic() > deadline:
                raise TimeoutError(f"no release after {after!r} within {timeout:g} s")
            time.sleep(interval)


class AsyncReefClient(_Base):
    """The asynchronous twin of :class:`ReefClient` (same arguments, awaitable methods)."""

    def __init__(self, url: str | None = None, *, transport: httpx.AsyncBaseTransport | None = None, **kwargs):
        super().__init__(url, **kwargs)
        self._http = httpx.AsyncClient(base_url=self.url, timeout=self.timeout, transport=transport)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncReefClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _run(self, call: _Call) -> Any:
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                response = await self._http.request(call.method, call.path, **self._request_kwargs(call))
            except httpx.TransportError as exc:
                if last:
                    raise Unreachable(f"{self.url}: {exc}") from exc
                await asyncio.sleep(self._delay(attempt, None))
                continue
            if response.status_code in RETRY_STATUSES and not last and _worth_retrying(response):
                await asyncio.sleep(self._delay(attempt, response))
                continue
            return self._outcome(response)

    def http_client(self, module=httpx):
        return capture_client(module, self.scenario, self.inference_headers(), self.receipts, asynchronous=True,
                              timeout=self.timeout)

    def openai(self, client=None, **kwargs):
        """An ``openai.AsyncOpenAI`` pointed at Reef (or ``client`` copied with Reef's transport)."""
        import openai

        if client is not None:
            return client.with_options(http_client=self.http_client())
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.token or "reef",
                                  http_client=self.http_client(), **kwargs)

    def anthropic(self, client=None, **kwargs):
        import anthropic

        module = _sdk_http(anthropic)
        if client is not None:
            return client.with_options(http_client=self.http_client(module))
        return anthropic.AsyncAnthropic(base_url=self.url, api_key=self.token or "reef",
                                        http_client=self.http_client(module), **kwargs)

    async def report(self, *, score: float | None = None, feedback: Any = None, references: Any = "last",
                     metadata: dict | None = None, report_id: str | None = None) -> dict:
        call, closes = self._report_call(score, feedback, references, metadata, report_id)
        answer = await self._run(call)
        if closes is not None:
            self.receipts.close_session(closes)
        return answer

    async def import_records(self, items: Iterable[Any], *, batch_size: int = DEFAULT_BATCH,
                             progress: Callable[[int], None] | None = None) -> list[dict]:
        """:meth:`ReefClient.import_records`, awaitable."""
        receipts: list[dict] = []
        scenario = self._need_scenario()
        groups = (line_envelopes(item, scenario, f"item {i}") for i, item in enumerate(items))
        for batch in batches(groups, batch_size):
            answer = await self._run(_Call("POST", "/reef/records/batch", json={"records": batch}))
            receipts.extend(answer["records"])
            if progress is not None:
                progress(len(batch))
        return receipts

    async def records(self, *, after_sequence: int = 0, limit: int | None = None) -> list[dict]:
        rows: list[dict] = []
        cursor = after_sequence
        while limit is None or len(rows) < limit:
            page = await self._run(_Call("GET", self._scenario_path("records"),
                                         params={"after_sequence": cursor, "limit": 100}, scenario_header=False))
            rows.extend(page["records"])
            if page.get("next_after_sequence") is None:
                break
            cursor = page["next_after_sequence"]
        return rows if limit is None else rows[:limit]

    async def record(self, record_id: str) -> dict:
        return await self._run(_Call("GET", self._scenario_path(f"records/{quote(record_id, safe='')}"),
                                     scenario_header=False))

    async def releases(self) -> list[dict]:
        return (await self._run(_Call("GET", self._scenario_path("releases"), scenario_header=False)))["releases"]

    async def commits(self, *, after_step: int = 0, limit: int = 50) -> list[dict]:
        return (await self._run(_Call("GET", self._scenario_path("commits"),
                                      params={"after_step": after_step, "limit": limit},
                                      scenario_header=False)))["commits"]

    async def status(self) -> dict:
        return await self._run(_Call("GET", self._scenario_path("status"), scenario_header=False))

    async def server_status(self) -> dict:
        return await self._run(_Call("GET", "/reef/status", scenario_header=False))

    async def harness(self, directory: str | os.PathLike | None = None, *, release_id: str | None = None) -> dict:
        params = {"release_id": release_id} if release_id else None
        tree = await self._run(_Call("GET", "/reef/harness", params=params))
        if directory is not None:
            tree["written"] = await asyncio.to_thread(write_tree, directory, tree["release_id"],
                                                      tree.get("content_id"), tree["files"])
        return tree

    async def wait_for_release(self, after: str | None, *, timeout: float = 300.0, interval: float = 0.5) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            current = _current(await self.releases())
            if current is not None and current.get("release_id") != after:
                return current
            if time.monotonic() > deadline:
                raise TimeoutError(f"no release after {after!r} within {timeout:g} s")
            await asyncio.sleep(interval)


def _current(rows: Iterable[dict]) -> dict | None:
    rows = list(rows)
    return next((r for r in rows if r.get("current")), rows[-1] if rows else None)


def _sdk_http(sdk):
    """The HTTP library an SDK is built on: ``httpx``, or the ``httpx2`` fork newer Anthropic SDKs require."""
    import importlib

    base = importlib.import_module(f"{sdk.__name__}._base_client")
    for name in ("httpx2", "httpx"):
        module = getattr(base, name, None)
        if module is not None:
            return module
    return httpx
