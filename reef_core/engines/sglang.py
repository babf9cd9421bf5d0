"""SGLangEngine: drive an SGLang server over HTTP, with token capture, versioned weights and per-version LoRA.

Reef never imports SGLang: the server runs in its own environment (``engine.url``); this engine is its HTTP client.
It speaks OpenAI Chat Completions to the server side of Reef (Anthropic clients are translated by the server).

Two paths per request (``EngineRequest.tokens``):

* **Training scenarios** (``tokens=True``: a weights recipe): Reef renders the chat template with the model's own
  tokenizer (``engine.model``, a local directory holding the same tokenizer the server loaded) and calls SGLang's
  native ``/generate`` with ``input_ids``, explicit ``sampling_params``, ``return_logprob`` and, with
  ``engine.top_k_logprobs`` = K > 0, ``top_logprobs_num`` = K. The result becomes :class:`TokenData` (prompt ids,
  output ids, per-token log-probs, top-K) stamped with the version that produced it: the server's
  ``meta_info.weight_version`` for the base, the adapter's own version for a LoRA scenario. The client gets an
  OpenAI body (plain or streamed); tool calls are parsed from the text with ``engine.tool_call_parser``.
* **Record-only and harness scenarios** (``tokens=False``): the body goes unchanged to SGLang's OpenAI-compatible
  ``/v1/chat/completions`` (:class:`~reef_core.engines.upstream.UpstreamEngine`).

Log-probs. :class:`TokenData` needs ``log_softmax(logits)`` at temperature 1, while SGLang by default returns them at
the request's temperature. Reef relies on the server running with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` and checks it
at start-up: one prompt's top log-probs are asked for at temperature 1 and 0.5; if they differ the engine refuses
to start (:class:`ConfigError` naming the fix).

Weights (the existing :class:`~reef_core.surfaces.weights.WeightsSurface` drives both through the same methods as the
embedded engine):

* :meth:`swap_weights` (full weights): the release is written as an HF safetensors directory under
  ``engine.weights_dir`` (base files plus the changed tensors), admission closes (for pass-through requests too),
  Reef's in-flight requests drain, pass-through ones included (up to ``engine.drain_timeout_s``), generation is paused
  with ``abort``, ``update_weights_from_disk`` loads it under the release's version, ``/model_info`` must then report
  that version, and generation resumes. Any failure raises with the previous release still serving (the learner
  then restores the head). Why ``abort``: the update flushes the KV cache and SGLang's scheduler asserts that the
  flush succeeded; the flush refuses while the scheduler holds any request, and ``in_place`` keeps requests running
  while ``retract`` only moves them back to the waiting queue, so either kills the server when a request is left.
  ``abort`` ends what Reef could not drain: its own requests past the drain timeout (retried) and those of clients
  that reach the server beside Reef.
* :meth:`load_adapter` (LoRA): the adapter is written as a PEFT directory and loaded under a versioned name
  ``<scenario-key>-v<sequence>``, never in place; from then on the scenario's requests carry that name. The previous
  adapter is unloaded once its in-flight requests are done. ``engine.max_loaded_loras`` bounds the adapters Reef
  keeps loaded: the least recently used idle one is unloaded and reloaded from its directory when next needed.

Requests the engine aborted (finish reason ``abort``, e.g. during an update) are retried with backoff (0.05 s doubling
to 1 s) until ``engine.retry_timeout_s``; past it the request fails with :class:`UpstreamTimeout`. A stream aborted
after it relayed text cannot be replayed: it ends with an :class:`UpstreamError` (stored as incomplete, never trained).

Streams: cumulative chunks by default; a server started with ``--incremental-streaming-output`` (read from
``/server_info``, ``/get_server_info`` on servers before it) sends only what is new, and Reef accumulates them.

Seeds: SGLang honours ``sampling_seed`` only with ``--enable-deterministic-inference`` (said at start-up when it is
off and ``engine.seed`` is set) and keeps it in an int32 tensor in some versions (an overflow kills the scheduler), so
seeds are reduced into ``[0, 2**31)``.

The served model: at start-up one short probe prompt's ``input_token_logprobs`` (``logprob_start_len=0``) are
compared with a local fp32 forward pass of ``engine.model``; a mean difference past
:data:`MODEL_PROBE_TOLERANCE` nats (bf16 serving stays far below it, another model far above) is a
:class:`ConfigError` naming the model. ``check_logprobs=False`` skips it with the log-prob check.

Adapters are written as SGLang's LoRA loader reads them: ``target_modules`` as short module names (peft writes full
paths for ``all-linear``; SGLang keeps only the last component anyway), and what the loader ignores is refused at
publish naming the field (``use_dora``, ``use_rslora``, ``bias``, ``modules_to_save``, rank/alpha patterns, a
``layers_pattern`` other than ``layers``, a ``layers_to_transform`` that the tensors do not match: SGLang applies
whatever layer tensors the file holds), as are target modules the server was not started with
(``--lora-target-modules``).

Checked against SGLang's source (sgl-project/sglang): ``managers/scheduler.py`` @
0003215cf1464f44b389cd0b18d0b4c56f2a3da6, ``managers/scheduler_components/weight_updater.py`` @
00a2ca2e56d59f0a19186d7a8a58bdda5201023f, ``entrypoints/http_server.py`` @ 0025436eab0556737d615b36a4dd3e1e26e82f3d,
``lora/utils.py`` @ 01235a1633d19644d861f3542011bf35aeaee114, ``lora/lora_config.py`` @
0ceb81fe4868b3364267a661da67b5d88aa45fc3.

Start-up: waits for ``GET /health`` (``engine.ready_timeout_s``), checks log-probs, labels the served weights with this
process's base version (reloading the base first when an earlier Reef process left a release loaded) and unloads
adapters an earlier Reef process left behind (Reef's adapter names), so restart recovery reloads current releases.

This class holds only what is SGLang's protocol; admission and drain, retries, adapter residency, writing releases,
TokenData mapping and passthrough are :class:`~reef_core.engines.remote.RemoteEngine`'s (shared with vLLM).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from reef_core.models.adapter import AdapterWeights
from reef_core.engines.base import EngineRequest, EngineResponse, StreamEvent
from reef_core.engines.chat_body import SamplingParams
from reef_core.engines.remote import ADAPTER_NAME, Generation, RemoteEngine, adapter_name
from reef_core.errors import ConfigError, UpstreamError

__all__ = ["SGLangEngine", "adapter_name", "ADAPTER_NAME", "MODEL_PROBE_TOLERANCE"]

log = logging.getLogger("reef.engines.sglang")

#: Mean |served - local| input-token log-prob (nats) past which the server serves another model than engine.model.
#: bf16 serving against an fp32 forward differs by a few hundredths; a different model by whole nats.
MODEL_PROBE_TOLERANCE = 0.25
_PROBE_TEXT = "The quick brown fox jumps over the lazy dog. One, two, three, four."
#: Module names SGLang's LoRA loader can place (after it maps q/k/v and gate/up onto its fused layers).
_SGLANG_LORA_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                  "qkv_proj", "gate_up_proj", "out_proj", "embed_tokens", "lm_head"})
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class SGLangEngine(RemoteEngine):
    """An SGLang server at ``url`` (see the module docstring; arguments are :class:`RemoteEngine`'s)."""

    protocol = "SGLang"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server_info: dict = {}
        self.incremental_stream = False
        self._passthrough = 0  # pass-through requests in flight (a full-weight publish drains them too)

    # ---- start-up -----------------------------------------------------------------------------------------
    async def _after_ready(self) -> None:
        try:
            self.server_info = await self._get("/server_info")
        except UpstreamError as exc:
            if exc.details.get("status") != 404:
                raise
            self.server_info = await self._get("/get_server_info")  # SGLang before /server_info
        self.incremental_stream = bool(self.server_info.get("incremental_streaming_output"))
        if not self.server_info.get("enable_deterministic_inference"):
            (log.warning if self.seed is not None else log.info)(
                "the SGLang server at %s ignores sampling seeds (engine.seed and request seeds): start it with "
                "--enable-deterministic-inference for seeded sampling", self.url)

    async def _check_original_logprobs(self) -> None:
        """Refuse a server whose log-probs follow the request's temperature (see the module docstring)."""
        ids = await asyncio.to_thread(self._prompt_ids, [{"role": "user", "content": "Hello"}], None)
        tops = []
        for temperature in (1.0, 0.5):
            out = await self._call("/generate", {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 5,
                                                 "sampling_params": {"max_new_tokens": 1, "temperature": temperature}})
            tops.append({int(i): float(lp) for lp, i, *_ in out["meta_info"]["output_top_logprobs"][0]})
        if self._temperature_probe_differs(tops):
            raise ConfigError(f"the SGLang server at {self.url} returns log-probs at the request's temperature; Reef "
                              "records temperature-1 log-probs for training: start it with "
                              "SGLANG_RETURN_ORIGINAL_LOGPROB=1 (engine.launch sets it)")

    async def _check_served_model(self) -> None:
        """Refuse a server that does not serve engine.model: one probe prompt's log-probs against a local forward."""
        ids = list(self._tok(_PROBE_TEXT, add_special_tokens=False)["input_ids"])
        out = await self._call("/generate", {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                                             "sampling_params": {"max_new_tokens": 1, "temperature": 1.0}})
        rows = (out.get("meta_info") or {}).get("input_token_logprobs") or []
        served = {i: float(r[0]) for i, r in enumerate(rows) if r and r[0] is not None and i < len(ids)
                  and int(r[1]) == ids[i]}
        if len(served) < len(ids) - 1:
            raise UpstreamError(f"SGLang did not return input_token_logprobs for the model probe ({len(rows)} rows "
                                f"for {len(ids)} tokens)")
        local = await asyncio.to_thread(_local_logprobs, self.model_dir, ids)
        diff = sum(abs(served[i] - local[i]) for i in served) / len(served)
        if diff > MODEL_PROBE_TOLERANCE:
            where = self.server_info.get("model_path") or "another model"
            raise ConfigError(f"the SGLang server at {self.url} does not serve engine.model {self.model_dir}: its "
                              f"log-probs of a probe prompt differ from a local forward pass by {diff:.3f} nats a "
                              f"token (tolerance {MODEL_PROBE_TOLERANCE}); it serves {where}")

    async def _label_base(self) -> None:
        served = (await self._get("/model_info")).get("weight_version")
        if isinstance(served, str) and ":" in served and not served.endswith(":0"):
            # An earlier Reef process published a release into this server: serve the base again.
            await self._update_from_disk(self.model_dir, self.version)
        else:
            await self._call("/update_weight_version", {"new_version": self.version, "abort_all_requests": False})
        if self.check_logprobs:  # now that the base serves (a release an earlier process left is gone)
            await self._check_served_model()

    # ---- full weights ------------------------------------------------------------------------------------
    async def _paused_update(self, path: Path | None, version: str) -> None:
        """Drain, pause, load or relabel, verify, continue. A load flushes the cache, which SGLang asserts and which
        fails while its scheduler holds any request: ``abort`` is the one pause that leaves none (see the module
        docstring); a relabel flushes nothing and keeps drained-in-time requests ``in_place``."""
        drained = await self._drain()
        await self._call("/pause_generation", {"mode": "in_place" if drained and path is None else "abort"})
        try:
            if path is None:
                await self._call("/update_weight_version", {"new_version": version, "abort_all_requests": False})
            else:
                await self._update_from_disk(path, version)
        finally:
            await self._call("/continue_generation", {}, check=False)

    async def _drain(self) -> bool:
        """Wait until no request of Reef's, pass-through ones included, is in flight (``engine.drain_timeout_s``)."""
        try:
            async with asyncio.timeout(self.drain_timeout_s):
                async with self._drained:
                    await self._drained.wait_for(lambda: self._in_flight == 0 and self._passthrough == 0)
            return True
        except TimeoutError:
            return False

    async def _update_from_disk(self, path: Path, version: str) -> None:
        # Absolute: the server resolves a relative path against its own working directory.
        await self._call("/update_weights_from_disk", {"model_path": str(Path(path).absolute()),
                                                        "weight_version": version, "flush_cache": True})
        served = (await self._get("/model_info")).get("weight_version")
        if served != version:
            raise UpstreamError(f"SGLang reports weight version {served!r} after loading {version!r}")

    # ---- pass-through requests: counted, and held while a full-weight publish pauses the server ------------
    @contextlib.asynccontextmanager
    async def _passing(self):
        await self._open.wait()
        self._passthrough += 1
        try:
            yield
        finally:
            self._passthrough -= 1
            async with self._drained:
                self._drained.notify_all()

    async def complete(self, req: EngineRequest) -> EngineResponse:
        if req.tokens or req.route == "count_tokens" or self._open is None:
            return await super().complete(req)
        async with self._passing():
            return await super().complete(req)

    async def stream(self, req: EngineRequest) -> AsyncIterator[StreamEvent]:
        if req.tokens or self._open is None:
            async for ev in super().stream(req):
                yield ev
            return
        async with self._passing():
            async for ev in super().stream(req):
                yield ev

    # ---- adapters ----------------------------------------------------------------------------------------
    def _write_adapter(self, name: str, adapter: AdapterWeights) -> Path:
        return super()._write_adapter(name, AdapterWeights(self._sglang_adapter_config(adapter), adapter.tensors))

    def _sglang_adapter_config(self, adapter: AdapterWeights) -> dict:
        """``adapter``'s config as SGLang's LoRA loader reads it; ConfigError naming a field it cannot honour."""
        config = dict(adapter.config)

        def refuse(field: str, why: str) -> None:
            raise ConfigError(f"adapter_config.{field}={config.get(field)!r}: SGLang's LoRA loader {why}; train the "
                              "adapter without it to serve it on SGLang")

        for field in ("use_dora", "use_rslora"):
            if config.get(field):
                refuse(field, "does not apply it (scaling is lora_alpha / r)" if field == "use_rslora"
                       else "does not load DoRA magnitudes")
        if config.get("bias", "none") not in (None, "none"):
            refuse("bias", "loads no LoRA bias terms")
        for field in ("modules_to_save", "rank_pattern", "alpha_pattern"):
            if config.get(field):
                refuse(field, "applies one r and lora_alpha to whole modules and saves no others")
        if config.get("layers_pattern") not in (None, "layers", ["layers"]):
            refuse("layers_pattern", "finds layers only as 'layers.<n>.' in tensor names")
        targets = config.get("target_modules")
        if isinstance(targets, str):
            if targets not in ("all", "all-linear"):
                refuse("target_modules", "takes a list of module names or 'all' / 'all-linear'")
            names = None
        else:
            names = sorted({str(t).rsplit(".", 1)[-1] for t in targets or []})
            unknown = [n for n in names if n not in _SGLANG_LORA_MODULES]
            if not names or unknown:
                refuse("target_modules", f"cannot place {unknown or 'an empty list'}")
            config["target_modules"] = names  # short names: what SGLang matches (peft writes full paths)
            served = self.server_info.get("lora_target_modules")
            if isinstance(served, list) and served and "all" not in served:
                allowed = {_FUSED.get(m, m) for m in served} | set(served)
                missing = [n for n in names if n not in allowed and _FUSED.get(n, n) not in allowed]
                if missing:
                    refuse("target_modules", f"was started with --lora-target-modules {served}, not {missing}")
        layers = sorted({int(m.group(1)) for k in adapter.tensors for m in [_LAYER.search(k)] if m})
        wanted = config.get("layers_to_transform")
        if wanted is not None:
            wanted = [wanted] if isinstance(wanted, int) else list(wanted)
            if not set(layers) <= set(wanted):  # SGLang applies every layer the tensors hold
                refuse("layers_to_transform", f"ignores it and applies the tensors of layers {layers}")
        return config

    async def _load_remote(self, name: str, path: Path) -> None:
        await self._call("/load_lora_adapter", {"lora_name": name, "lora_path": str(Path(path).absolute())})

    async def _unload_remote(self, name: str) -> None:
        await self._call("/unload_lora_adapter", {"lora_name": name}, check=False)

    # ---- generation: native /generate --------------------------------------------------------------------
    def _native_body(self, prompt_ids: list[int], s: SamplingParams, top: int, adapter: str | None,
                     stream: bool) -> dict:
        params: dict[str, Any] = {"max_new_tokens": s.max_new, "temperature": s.temperature, "top_p": s.top_p,
                                  "top_k": -1, "min_p": 0.0}
        if s.stops:
            params["stop"] = s.stops
        if s.seed is not None:  # some SGLang versions hold it in an int32 tensor (an overflow kills the scheduler)
            params["sampling_seed"] = int(s.seed) % 2 ** 31
        out = {"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True, "stream": stream,
               "rid": uuid.uuid4().hex}
        if top:
            out["top_logprobs_num"] = top
        if adapter is not None:
            out["lora_path"] = adapter
        return out

    async def _generate_once(self, payload: dict) -> Generation | EngineResponse:
        out = await self._post_json("/generate", payload)
        if isinstance(out, EngineResponse):
            return out
        return _generation(out)

    async def _stream_once(self, payload: dict) -> AsyncIterator[Generation]:
        if not self.incremental_stream:
            async for state in self._sse_json("/generate", payload):  # cumulative: each chunk is the answer so far
                yield _generation(state)
            return
        so_far: Generation | None = None
        async for state in self._sse_json("/generate", payload):  # each chunk holds only what is new
            piece = _generation(state)
            if so_far is None:
                so_far = piece
            else:
                top = so_far.top + piece.top if so_far.top is not None and piece.top is not None else None
                so_far = Generation(so_far.text + piece.text, so_far.output_ids + piece.output_ids,
                                    so_far.logprobs + piece.logprobs, top, piece.finish, piece.message,
                                    piece.version or so_far.version)
            yield so_far


def _generation(out: dict) -> Generation:
    """A /generate answer (or cumulative stream chunk) as a :class:`Generation`."""
    meta = out.get("meta_info")
    if not isinstance(meta, dict):
        raise UpstreamError("SGLang /generate answer has no meta_info")
    finish = meta.get("finish_reason") or {}
    ids = out.get("output_ids")
    triples = meta.get("output_token_logprobs")
    if not isinstance(ids, list) or not isinstance(triples, list) or len(triples) != len(ids):
        raise UpstreamError("SGLang answer lacks per-token log-probs for its output ids")
    if any(int(t[1]) != i for t, i in zip(triples, ids)):
        raise UpstreamError("SGLang log-probs name other tokens than its output ids")
    rows = meta.get("output_top_logprobs")
    top = [[(int(i), float(lp)) for lp, i, *_ in row] for row in rows] if isinstance(rows, list) else None
    return Generation(text=out.get("text") or "", output_ids=[int(i) for i in ids],
                      logprobs=[float(t[0]) for t in triples], top=top, finish=finish.get("type"),
                      message=finish.get("message"), version=meta.get("weight_version"))


def _local_logprobs(model_dir: Path, ids: list[int]) -> dict[int, float]:
    """Position -> fp32 log-prob of ``ids[pos]`` after ``ids[:pos]`` under the model in ``model_dir`` (CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    return {i: float(logp[i - 1, ids[i]]) for i in range(1, len(ids))}
