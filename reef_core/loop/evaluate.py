"""Candidate-only evaluation (``POST /reef/scenarios/{s}/evaluate``): one chat answered as a named release of a
scenario would serve it, on the deployment's private engine, recording and training nothing.

The private engine is the one ``reef eval releases`` uses (:mod:`reef_core.loop.release_eval`): with
``engine.kind=local`` a second copy of the base model holding one weights release at a time (keyed by content id, so
the same content again loads nothing), which harness releases share at the base weights; with
``engine.kind=upstream`` a private client of the provider, for harness releases only. It is built on the first
evaluate call (a model load) and kept until the server stops: one per deployment, never the serving engine, so what
serves (its weights, its version) never moves.

Each call runs on the evaluator's own thread (:meth:`Evaluator.submit`), so the event loop and the worker threads
that serve reads never wait on a generation, and calls generate one at a time. At most :data:`ADMITTED` are in at
once, one running and the rest queued on that thread; one more is refused at once with a 429 ``evaluation_busy`` and
a retry-after, so callers back off instead of queueing without bound. A slot frees when its job ends (or is dropped
before it starts), not when its caller goes away.

Nothing is written: no record, no receipt, and no processor or learner sees the chat.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import Conflict, NotFound, RateLimited, ReefError, UpstreamError, ValidationFailed
from ..grow.eval_engine import EngineRefused, EvalGeneration
from .aliases import named
from .release_eval import HarnessReleases, LoadFailed, Reply, private_generator, weights_releases

#: ``release: candidate``: the scenario's newest release held for review (``publish: review``).
CANDIDATE = "candidate"
#: Evaluate calls in at once (one generating, the others waiting for the engine).
ADMITTED = 4
#: The engine kinds a private engine can evaluate each surface's releases on.
ENGINE_KINDS = {"weights": ("local",), "harness": ("local", "upstream")}


class EvaluationBusy(RateLimited):
    """Every evaluate slot is taken: come back after ``retry_after`` seconds."""

    code = "evaluation_busy"


def resolve(value: str, rows: list[dict], aliases: Mapping[str, str]) -> dict:
    """The release row ``value`` names among the scenario's ``rows``: a release id, ``production``, an alias, or
    ``candidate`` (the newest release held for review, unless an alias has that name). 404 naming ``release`` for
    none; 409 for a release with nothing to load (a live version not yet checkpointed, weights ``reef gc`` pruned)."""
    found = named(value, rows, aliases)
    if found is None and value == CANDIDATE:
        held = [row for row in rows if row.get("pending")]
        if not held:
            raise NotFound("release: the scenario holds no candidate for review (a gate with publish: review holds "
                           "them); name a release id or an alias", param="release")
        found = max(held, key=lambda row: row.get("created_at") or "")["release_id"]
    row = next((r for r in rows if r.get("release_id") == found), None)
    if row is None:
        raise NotFound(f"release: the scenario has no release or alias {value[:80]!r}", param="release")
    if not row.get("checkpoint", True):
        raise Conflict(f"release: {value[:80]!r} is a live version ({row['release_id']}) with no files yet; evaluate "
                       "a checkpointed release", param="release")
    if row.get("restorable") is False:
        raise Conflict(f"release: the weights of release {row['release_id']} were pruned (reef gc)", param="release")
    return row


def generation_of(options: Mapping[str, Any] | None, asked: Mapping[str, Any]) -> EvalGeneration:
    """The recipe's evaluation generation settings (``evaluation.options.generation``, greedy by default) under the
    call's own ``max_tokens``, ``temperature`` and ``seed``."""
    base = EvalGeneration.from_options(options)
    return dataclasses.replace(base, **{k: asked[k] for k in ("max_tokens", "temperature", "seed")
                                        if asked.get(k) is not None})


class Evaluator:
    """The deployment's private engine for evaluate calls (see the module docstring)."""

    def __init__(self, cfg: Any, plugin_manager: Any):
        self.cfg = cfg
        self.pm = plugin_manager
        self._generator: Any = None
        self._weights: Any = None
        self._harness: dict[int, HarnessReleases] = {}  # per harness surface (its system files, inject mode)
        #: The last release prepared per surface kind, by content: a weights Reply holds the release's bytes.
        self._last: dict[str, tuple[Any, Reply]] = {}
        self._count = threading.Lock()
        self._admitted = 0
        self._thread: ThreadPoolExecutor | None = None
        #: Answered calls and calls refused busy (the scenario status does not show them; tests and logs may).
        self.answered = self.busy = 0

    def check(self, kind: str) -> None:
        """409 for releases the private engine cannot serve under this deployment's engine."""
        kinds = ENGINE_KINDS.get(kind)
        if kinds is None:
            raise Conflict(f"release: the scenario's surface is {kind!r}; evaluate serves weights and harness "
                           "releases only", param="release")
        if self.cfg.engine.kind not in kinds:
            raise Conflict(f"release: evaluating {kind} releases needs engine.kind={' or '.join(kinds)} (a private "
                           f"engine loads the release), not {self.cfg.engine.kind!r}", param="release")

    async def submit(self, job: Callable[[], Any]) -> Any:
        """``job()`` on the evaluator's thread, once a slot is free (else EvaluationBusy at once)."""
        with self._count:
            if self._admitted >= ADMITTED:
                self.busy += 1
                raise EvaluationBusy(f"{ADMITTED} evaluate calls are in already (one runs at a time); retry shortly",
                                     retry_after=1)
            self._admitted += 1
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="reef-evaluate")
        try:
            future = self._thread.submit(job)
        except BaseException:
            self._free()
            raise
        future.add_done_callback(lambda _: self._free())
        return await asyncio.wrap_future(future)

    def _free(self) -> None:
        with self._count:
            self._admitted -= 1

    def _runner(self, kind: str, surface: Any):
        """The private engine's runner for ``kind`` (on the evaluator's thread only: no lock needed)."""
        if self._generator is None:  # lazy: no model loads until the first evaluate call generates
            max_new = self.cfg.learn.max_tokens or self.cfg.engine.max_new_tokens
            self._generator = private_generator(self.cfg, EvalGeneration(), max_new, self.pm)
            if self.cfg.engine.kind == "local":
                self._weights = weights_releases(self._generator)
        if kind == "weights":
            return self._weights
        found = self._harness.get(id(surface))
        if found is None:
            base = self._weights.base() if self._weights is not None else None
            found = self._harness[id(surface)] = HarnessReleases(self._generator, surface, base)
        return found

    def _reply(self, kind: str, surface: Any, release: Any, read: Callable[[], Mapping[str, bytes]]) -> Reply:
        key = (id(surface), release.content_id)
        last = self._last.get(kind)
        if last is not None and last[0] == key:
            return last[1]
        runner = self._runner(kind, surface)
        files = read()  # Conflict (409) for a release pruned since it was listed
        try:
            runner.check(release, lambda: files)  # a tree the surface would not serve, another base model's weights
        except ReefError as exc:
            raise Conflict(f"release: {exc.message}", param="release") from None
        reply = runner.prepare(release.release_id, release.content_id, files)
        self._last[kind] = (key, reply)
        return reply

    def answer(self, kind: str, surface: Any, release: Any, read: Callable[[], Mapping[str, bytes]],
               messages: list[dict], generation: EvalGeneration) -> dict:
        """The OpenAI chat completion ``release`` answers ``messages`` with (blocking: a :meth:`submit` job)."""
        self.check(kind)
        reply = self._reply(kind, surface, release, read)
        try:
            answer = reply.complete(messages, generation)
        except LoadFailed as exc:
            self._last.pop(kind, None)
            raise Conflict(f"release: {exc.message}", param="release") from None
        except EngineRefused as exc:
            status = exc.details.get("engine_status", 500)
            if 400 <= status < 500:
                raise ValidationFailed(f"messages: the private engine refused the chat ({status})",
                                       param="messages") from None
            raise UpstreamError(f"the private engine failed ({status})") from None
        self.answered += 1
        return answer

    def close(self) -> None:
        """Stop the thread (after the job it runs) and free the private engine."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.shutdown(wait=True, cancel_futures=True)
        if self._generator is not None:
            self._generator.close()
        self._generator = self._weights = None
        self._harness.clear()
        self._last.clear()
