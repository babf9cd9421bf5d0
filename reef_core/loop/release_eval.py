"""Answer tasks as one release would serve them, through a private engine (``reef eval releases``).

Nothing here touches a deployment: no record store, no learner, no surface that serves. Two kinds of release:

* **weights** (the ``weights`` surface): a second local engine of the base model
  (:class:`~reef_core.grow.eval_engine.EvalEngine`, greedy and seeded by default) holds each release in turn: a
  creation release (``base.json``) is the base model, whose digest must match the one it names; a full-weight
  release's ``model.safetensors`` is swapped in; a LoRA release's ``adapter/`` is loaded over the untouched base.
  Weights are keyed by content id, so a rollback to an earlier release's content loads nothing new.
* **harness** (the built-in ``harness`` surface): the base model (``engine.kind=local``, the same private engine)
  or a private client of the upstream provider (``engine.kind=upstream``) answers each task with the release's
  system prompt put in front, as ``inject: system`` serves it and as a client that pulls the tree would send it
  (the surface's ``system_files`` and ``inject_mode``).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engines.base import GENERATE_ROUTE, EngineRequest
from ..engines.translate import translate_request, translate_response
from ..errors import ConfigError, ReefError, ValidationFailed
from ..grow.eval_engine import EngineRefused, EvalEngine, EvalGeneration, reply_text
from ..models.release_files import ADAPTER_WEIGHTS, BASE_REFERENCE, MODEL_FILE, base_reference
from ..surfaces.harness import HarnessSurface, inject_system, render_system_prompt

KINDS = ("weights", "harness")


class LoadFailed(ReefError):
    """A release's weights did not load into the private engine: the release is not scored (its row's ``error``)."""


def _keep(engine: Any) -> None:
    """``load`` of a generation that needs no weights of its own (the engine keeps what it holds)."""


def _as_sent(messages: list[dict]) -> list[dict]:
    return messages


@dataclass(frozen=True)
class Reply:
    """How one release answers a chat: ``reply(messages)`` is its text (what a verifier reads), :meth:`complete`
    the engine's whole OpenAI chat completion under one call's generation settings."""

    generator: Any
    #: The weights the generator must hold (``load`` puts them in when it holds others).
    key: Any
    load: Callable[[Any], None]
    #: The chat as the release serves it (a harness release puts its system prompt in front).
    shape: Callable[[list[dict]], list[dict]] = _as_sent

    def complete(self, messages: list[dict], generation: EvalGeneration | None = None) -> dict:
        return self.generator.complete(self.key, self.load, self.shape(messages), generation)

    def __call__(self, messages: list[dict]) -> str:
        return reply_text(self.complete(messages))


class UpstreamGenerator:
    """A private upstream client with :class:`EvalEngine`'s ``generate`` (it has no weights: ``key`` and ``load``
    are ignored); its calls run on a loop it owns."""

    def __init__(self, engine: Any, generation: EvalGeneration, max_new_tokens: int):
        self.engine = engine
        self.generation = generation
        self.max_new_tokens = int(max_new_tokens)
        self._loop: asyncio.AbstractEventLoop | None = None

    def generate(self, key: Any, load: Callable[[Any], None], messages: list[dict]) -> str:
        return reply_text(self.complete(key, load, messages))

    def complete(self, key: Any, load: Callable[[Any], None], messages: list[dict],
                 generation: EvalGeneration | None = None) -> dict:
        """The provider's answer as an OpenAI chat completion, under ``generation`` if given, else this client's."""
        generation = generation or self.generation
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self.engine.start())
        max_tokens = generation.max_tokens or self.max_new_tokens
        body = {"model": "reef", "messages": messages, "temperature": generation.temperature,
                "max_tokens": max_tokens, "seed": generation.seed}
        dialect = "openai" if "openai" in self.engine.dialects else self.engine.dialects[0]
        body = translate_request(body, "openai", dialect, max_tokens)
        request = EngineRequest(dialect, GENERATE_ROUTE[dialect], body, tokens=False)
        response = self._loop.run_until_complete(self.engine.complete(request))
        if response.status >= 400:
            raise EngineRefused(f"the upstream provider refused a task ({response.status}): {response.body}",
                                engine_status=response.status)
        return translate_response(response.body, dialect, "openai")

    def close(self) -> None:
        if self._loop is not None:
            self._loop.run_until_complete(self.engine.close())
            self._loop.close()
            self._loop = None


class WeightsReleases:
    """Weights releases, each loaded into the private engine when its turn comes (see the module docstring)."""

    kind = "weights"

    def __init__(self, engine: EvalEngine, base_digest: Callable[[], str]):
        self.engine = engine
        self.base_digest = base_digest
        self._base: dict | None = None

    def _base_state(self) -> dict:
        if self._base is None:
            from ..models.loading import load_model

            self._base = load_model(self.engine.model_dir)[0].state_dict()
        return self._base

    def check(self, release: Any, read: Callable[[], Mapping[str, bytes]]) -> None:
        """Refuse, before any model loads, a release this engine cannot hold: no weights named in its manifest, or a
        creation release of another base model."""
        names = set(release.files)
        if BASE_REFERENCE in names:
            ref = base_reference(read())
            if ref["digest"] != self.base_digest():
                raise ConfigError(f"release {release.release_id} names base model {ref.get('model')!r} "
                                  f"({ref['digest']}), but engine.model is {str(self.engine.model_dir)!r} "
                                  f"({self.base_digest()}): evaluate with the scenario's own engine.model")
        elif MODEL_FILE not in names and ADAPTER_WEIGHTS not in names:
            raise ConfigError(f"release {release.release_id} holds no weights ({MODEL_FILE} or {ADAPTER_WEIGHTS}): "
                              "is the scenario's recipe (its surface) the one given?")

    def prepare(self, release_id: str, content_id: str, files: Mapping[str, bytes]) -> Reply:
        base = base_reference(files) is not None
        # Weights are named by content (a rollback's are an earlier release's); the base's load costs nothing while
        # the engine still holds the model it loaded (EvalEngine.restore_base).
        key = ("base",) if base else content_id

        def load(engine: Any) -> None:
            from ..models.adapter import AdapterWeights

            try:
                if base:
                    self.engine.restore_base(engine, self._base_state)
                elif MODEL_FILE in files:
                    from safetensors.torch import load as load_safetensors

                    self.engine.swap(engine, load_safetensors(files[MODEL_FILE]))
                else:
                    self.engine.swap(engine, AdapterWeights.from_files(files))
            except Exception as exc:  # noqa: BLE001 - safetensors, torch, peft or the engine refusing the files
                message = exc.message if isinstance(exc, ReefError) else f"{type(exc).__name__}: {exc}"
                raise LoadFailed(f"release {release_id}: its weights do not load: {message}"[:500]) from exc

        return Reply(self.engine, key, load)

    def base(self) -> tuple[Any, Callable[[Any], None]]:
        """(key, load) of the base model, for generations that share this engine but need no weights of their own
        (harness releases): whatever weights a release left in, the base serves them."""
        return ("base",), lambda engine: self.engine.restore_base(engine, self._base_state)

    def close(self) -> None:
        self.engine.close()


class HarnessReleases:
    """Harness releases: the release's system prompt in front of each task's chat, answered by ``generator``."""

    kind = "harness"

    def __init__(self, generator: Any, surface: HarnessSurface, base: tuple[Any, Callable[[Any], None]] | None = None):
        self.generator = generator
        self.surface = surface
        #: (key, load) of the weights the generator must hold: the base where weights releases share the engine
        #: (:meth:`WeightsReleases.base`), else whatever it holds (it never holds other weights).
        self.base = base or (None, _keep)

    def check(self, release: Any, read: Callable[[], Mapping[str, bytes]]) -> None:
        """Refuse a tree the harness surface would not serve, before any model loads."""
        try:
            self.surface.checked(read())
        except ValidationFailed as exc:
            raise ConfigError(f"release {release.release_id} is not a harness tree the surface serves: "
                              f"{exc.message}") from None

    def prepare(self, release_id: str, content_id: str, files: Mapping[str, bytes]) -> Reply:
        text = render_system_prompt(self.surface.checked(files), self.surface.system_files)

        def shape(messages: list[dict]) -> list[dict]:
            return inject_system("openai", {"messages": messages}, text, self.surface.inject_mode)["messages"]

        return Reply(self.generator, *self.base, shape)

    def close(self) -> None:
        self.generator.close()


def private_generator(cfg: Any, generation: EvalGeneration, max_new_tokens: int, plugin_manager: Any):
    """The private engine under ``cfg.engine``: a second local engine of the base model (``engine.kind=local``),
    else a private client of the provider; ConfigError for an engine kind that has neither."""
    from ..models.device import engine_device
    from ..models.loading import model_cache_dir, resolve_model

    data_dir = Path(cfg.storage.data_dir)
    if cfg.engine.kind == "local":
        model_dir = resolve_model(cfg.engine.model, data_dir, model_cache_dir(cfg.engine))
        return EvalEngine(model_dir, device=engine_device(cfg.engine), generation=generation,
                          max_new_tokens=max_new_tokens)
    if cfg.engine.kind != "upstream":
        raise ConfigError(f"evaluating releases needs engine.kind=local or upstream, not {cfg.engine.kind!r}")
    engine = plugin_manager.create("engine", cfg.engine.kind, config=cfg.engine, data_dir=data_dir)
    return UpstreamGenerator(engine, generation, max_new_tokens)


def weights_releases(generator: EvalEngine) -> WeightsReleases:
    from ..models.digest import model_digest

    return WeightsReleases(generator, functools.cache(lambda: model_digest(generator.model_dir)))  # hashed once


def release_runner(cfg: Any, kind: str, surface_options: Mapping[str, Any], generation: EvalGeneration,
                   max_new_tokens: int, plugin_manager: Any):
    """The private engine for ``kind`` releases under ``cfg.engine``; ConfigError for what it cannot evaluate."""
    if kind == "weights" and cfg.engine.kind != "local":
        raise ConfigError(f"evaluating weights releases needs engine.kind=local (a private copy of the base model "
                          f"loads each release), not {cfg.engine.kind!r}")
    if kind == "harness" and cfg.engine.kind not in ("local", "upstream"):
        raise ConfigError(f"evaluating harness releases needs engine.kind=local or upstream, not {cfg.engine.kind!r}")
    generator = private_generator(cfg, generation, max_new_tokens, plugin_manager)
    if kind == "harness":
        return HarnessReleases(generator, HarnessSurface(None, surface_options))
    return weights_releases(generator)
