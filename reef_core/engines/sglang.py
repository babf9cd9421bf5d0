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
  ``engine.weights_dir`` (base files plus the changed tensors), admission closes, in-flight requests drain (up to
  ``engine.drain_timeout_s``; past it they are aborted and retried), generation is paused, ``update_weights_from_disk``
  loads it under the release's version, ``/model_info`` must then report that version, and generation resumes. Any
  failure raises with the previous release still serving (the learner then restores the head).
* :meth:`load_adapter` (LoRA): the adapter is written as a PEFT directory and loaded under a versioned name
  ``<scenario-key>-v<sequence>``, never in place; from then on the scenario's requests carry that name. The previous
  adapter is unloaded once its in-flight requests are done. ``engine.max_loaded_loras`` bounds the adapters Reef
  keeps loaded: the least recently used idle one is unloaded and reloaded from its directory when next needed.

Requests the engine aborted (finish reason ``abort``, e.g. during an update) are retried with backoff (0.05 s doubling
to 1 s) until ``engine.retry_timeout_s``; past it the request fails with :class:`UpstreamTimeout`. A stream aborted
after it relayed text cannot be replayed: it ends with an :class:`UpstreamError` (stored as incomplete, never trained).

Start-up: waits for ``GET /health`` (``engine.ready_timeout_s``), checks log-probs, labels the served weights with this
process's base version (reloading the base first when an earlier Reef process left a release loaded) and unloads
adapters an earlier Reef process left behind (Reef's adapter names), so restart recovery reloads current releases.

This class holds only what is SGLang's protocol; admission and drain, retries, adapter residency, writing releases,
TokenData mapping and passthrough are :class:`~reef_core.engines.remote.RemoteEngine`'s (shared with vLLM).
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from reef_core.engines.base import EngineResponse
from reef_core.engines.chat_body import SamplingParams
from reef_core.engines.remote import ADAPTER_NAME, Generation, RemoteEngine, adapter_name
from reef_core.errors import ConfigError, UpstreamError

__all__ = ["SGLangEngine", "adapter_name", "ADAPTER_NAME"]


class SGLangEngine(RemoteEngine):
    """An SGLang server at ``url`` (see the module docstring; arguments are :class:`RemoteEngine`'s)."""

    protocol = "SGLang"

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

    async def _label_base(self) -> None:
        served = (await self._get("/model_info")).get("weight_version")
        if isinstance(served, str) and ":" in served and not served.endswith(":0"):
            # An earlier Reef process published a release into this server: serve the base again.
            await self._update_from_disk(self.model_dir, self.version)
        else:
            await self._call("/update_weight_version", {"new_version": self.version, "abort_all_requests": False})

    async def _paused_update(self, path: Path | None, version: str) -> None:
        """Drain, pause (``in_place``, or ``abort`` when the drain timed out), load or relabel, verify, continue."""
        drained = await self._drain()
        await self._call("/pause_generation", {"mode": "in_place" if drained else "abort"})
        try:
            if path is None:
                await self._call("/update_weight_version", {"new_version": version, "abort_all_requests": False})
            else:
                await self._update_from_disk(path, version)
        finally:
            await self._call("/continue_generation", {}, check=False)

    async def _update_from_disk(self, path: Path, version: str) -> None:
        await self._call("/update_weights_from_disk", {"model_path": str(path), "weight_version": version,
                                                        "flush_cache": True})
        served = (await self._get("/model_info")).get("weight_version")
        if served != version:
            raise UpstreamError(f"SGLang reports weight version {served!r} after loading {version!r}")

    async def _load_remote(self, name: str, path: Path) -> None:
        await self._call("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

    async def _unload_remote(self, name: str) -> None:
        await self._call("/unload_lora_adapter", {"lora_name": name}, check=False)

    # ---- generation: native /generate --------------------------------------------------------------------
    def _native_body(self, prompt_ids: list[int], s: SamplingParams, top: int, adapter: str | None,
                     stream: bool) -> dict:
        params: dict[str, Any] = {"max_new_tokens": s.max_new, "temperature": s.temperature, "top_p": s.top_p,
                                  "top_k": -1, "min_p": 0.0}
        if s.stops:
            params["stop"] = s.stops
        if s.seed is not None:
            params["sampling_seed"] = s.seed
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
        async for state in self._sse_json("/generate", payload):  # cumulative: each chunk is the answer so far
            yield _generation(state)


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
