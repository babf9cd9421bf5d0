"""A private engine for the evaluation gate of a weights trainer.

The gate compares a candidate with the release that serves by running evaluation tasks with both
(``Trainer.run_task(subject, task)``). A weights candidate is not served, so its tasks cannot go through
the serving engine; :class:`EvalEngine` is a second :class:`~reef_core.engines.local.LocalEngine` of the
same model directory, on the trainer's device, with its own worker thread and its own weights. Serving
never sees it: the serving engine's version and weights do not change while candidates are evaluated.

It is started on the first evaluation and kept for the next ones. Weights are loaded only when the
subject changes (:meth:`EvalEngine.generate` takes a ``key`` naming the weights and a ``load`` callable
that puts them in). Generation is deterministic by default: temperature 0 (greedy) and a fixed seed
per request, so a paired comparison of candidate and current release is repeatable.

Calls come from the learner's thread (never the server's event loop): each runs the engine's coroutine
on a loop this object owns, under a lock.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError, ReefError


class EngineRefused(ReefError):
    """The private engine answered a task with an error status (``engine_status``): a request it would not take
    (4xx), or its own failure."""


def reply_text(answer: dict) -> str:
    """The reply text of an OpenAI chat completion."""
    return answer["choices"][0]["message"]["content"] or ""


@dataclass(frozen=True)
class EvalGeneration:
    """How evaluation replies are generated (``evaluation.options.generation``)."""

    #: 0 is greedy: the same weights give the same reply.
    temperature: float = 0.0
    #: Reply budget; None uses the serving engine's ``engine.max_new_tokens``.
    max_tokens: int | None = None
    #: Seeds each request's sampler (matters only at temperature > 0).
    seed: int = 0

    @classmethod
    def from_options(cls, options: Any) -> "EvalGeneration":
        """Validated settings from ``evaluation.options.generation`` (a mapping, or None for the defaults)."""
        if options is None:
            return cls()
        if not isinstance(options, dict):
            raise ConfigError("evaluation.options.generation must be a mapping (temperature, max_tokens, seed)")
        unknown = sorted(set(options) - {"temperature", "max_tokens", "seed"})
        if unknown:
            raise ConfigError(f"evaluation.options.generation has unknown keys {unknown} "
                              "(known: temperature, max_tokens, seed)")
        try:
            temperature = float(options.get("temperature", 0.0))
            max_tokens = options.get("max_tokens")
            max_tokens = None if max_tokens is None else int(max_tokens)
            seed = int(options.get("seed", 0))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"evaluation.options.generation: {exc}") from None
        if not 0.0 <= temperature <= 2.0:
            raise ConfigError(f"evaluation.options.generation.temperature must be in [0, 2], got {temperature}")
        if max_tokens is not None and max_tokens < 1:
            raise ConfigError(f"evaluation.options.generation.max_tokens must be positive, got {max_tokens}")
        return cls(temperature=temperature, max_tokens=max_tokens, seed=seed)


class EvalEngine:
    """A lazily started, privately owned local engine; see the module docstring.

    Args:
        model_dir: the directory the serving engine loads (the base model); the subject's weights are
            swapped in before each generation.
        device: where the engine runs (the trainer's device).
        generation: reply settings.
        max_new_tokens: the reply budget when ``generation.max_tokens`` is unset.
    """

    def __init__(self, model_dir: str | Path, *, device: str, generation: EvalGeneration | None = None,
                 max_new_tokens: int = 64):
        self.model_dir = Path(model_dir)
        self.device = str(device)
        self.generation = generation or EvalGeneration()
        self.max_new_tokens = int(max_new_tokens)
        self._engine = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        #: The key of the weights the engine holds now (None: the base model it loaded).
        self.loaded_key: Any = None
        #: Weight loads so far (a test checks that an unchanged subject is not loaded again).
        self.loads = 0
        #: The version requests are frozen on: the subject's adapter line for a LoRA subject, else None (the
        #: engine's own weights).
        self._version: str | None = None
        #: Whether a full-weight swap moved the engine's own weights off the base it loaded.
        self._moved = False

    def _call(self, coro):
        return self._loop.run_until_complete(coro)

    def _started(self):
        if self._engine is None:
            from ..engines.local import LocalEngine

            engine = LocalEngine(self.model_dir, name="reef-eval", version="eval", device=self.device,
                                 max_new_tokens=self.max_new_tokens, temperature=self.generation.temperature,
                                 seed=self.generation.seed)
            self._loop = asyncio.new_event_loop()
            self._call(engine.start())
            self._engine = engine
        return self._engine

    def generate(self, key: Any, load: Callable[[Any], None], messages: list[dict]) -> str:
        """The reply to ``messages`` with the weights named ``key``; ``load(engine)`` puts them in when the
        engine holds other weights (an exception there leaves the engine marked as holding nothing known)."""
        return reply_text(self.complete(key, load, messages))

    def complete(self, key: Any, load: Callable[[Any], None], messages: list[dict],
                 generation: EvalGeneration | None = None) -> dict:
        """:meth:`generate`'s whole answer (an OpenAI chat completion), under ``generation`` if given (one call's
        settings, as ``POST /reef/scenarios/{s}/evaluate`` asks), else this engine's."""
        from ..engines.base import GENERATE_ROUTE, EngineRequest

        generation = generation or self.generation
        with self._lock:
            engine = self._started()
            if key != self.loaded_key:
                self.loaded_key = None
                load(engine)
                self.loaded_key = key
                self.loads += 1
            body = {"model": engine.name, "messages": messages, "temperature": generation.temperature,
                    "max_tokens": generation.max_tokens or self.max_new_tokens, "seed": generation.seed}
            request = EngineRequest("openai", GENERATE_ROUTE["openai"], body, version=self._version)
            response = self._call(engine.complete(request))
        if response.status >= 400:
            raise EngineRefused(f"the evaluation engine refused a task ({response.status}): {response.body}",
                                engine_status=response.status)
        return response.body

    def swap(self, engine, weights: Any) -> None:
        """Load the subject's weights into ``engine`` (called from ``load`` in :meth:`generate`): a (possibly
        partial) state dict replaces the engine's weights; an :class:`~reef_core.models.adapter.AdapterWeights`
        (a LoRA subject) becomes the one adapter the next requests are frozen on, over the untouched base."""
        from ..models.adapter import AdapterWeights

        if isinstance(weights, AdapterWeights):
            self._version = None
            self._call(engine.load_adapter("subject", "eval-subject:1", weights))
            self._version = "eval-subject:1"
        else:
            self._version = None
            self._call(engine.swap_weights("eval", weights))
            self._moved = True

    def restore_base(self, engine, base_state: Callable[[], dict]) -> None:
        """Serve the base model again (called from ``load``): requests leave any adapter line, and only weights a
        full swap moved are put back, from ``base_state()`` (a full swap is refused while adapters are loaded, and
        after adapters only the engine's own, untouched, weights are needed)."""
        self._version = None
        if self._moved:
            self._call(engine.swap_weights("eval", base_state()))
            self._moved = False

    def close(self) -> None:
        """Stop the worker and free the model (idempotent)."""
        with self._lock:
            if self._engine is not None:
                self._call(self._engine.close())
                self._engine = None
            if self._loop is not None:
                self._loop.close()
                self._loop = None
            self.loaded_key = None
            self._version, self._moved = None, False
