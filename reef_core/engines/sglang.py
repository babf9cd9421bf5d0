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
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import re
import shutil
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp

from reef_core.engines.adapter import AdapterWeights
from reef_core.engines.base import (
    TOKENS_EVENT,
    Engine,
    EngineRequest,
    EngineResponse,
    StreamEvent,
    TokenData,
    relay_status,
)
from reef_core.engines.chat_body import SamplingParams, chat_messages, sampling_params
from reef_core.engines.sse import SSEDecoder
from reef_core.engines.toolcalls import parse_tool_calls, tool_parser
from reef_core.engines.topk import MAX_K, TopK
from reef_core.engines.translate import anthropic_count_tokens_to_openai, error_body
from reef_core.errors import ConfigError, Conflict, ReefError, UpstreamError, UpstreamTimeout, ValidationFailed

log = logging.getLogger("reef.engines.sglang")

#: Names Reef gives adapters (``<8 hex key>-v<seq>``): what a restarted Reef unloads as left over.
ADAPTER_NAME = re.compile(r"^[0-9a-f]{8}-v\d+$")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
#: Body fields a training request may not carry: each would make the recorded log-probs disagree with the policy.
_REFUSED = ("logit_bias", "presence_penalty", "frequency_penalty")


def adapter_name(version: str) -> str:
    """The SGLang adapter name of a LoRA version ``<incarnation>.<key>:<seq>``: ``<key>-v<seq>``."""
    line, _, seq = version.rpartition(":")
    return f"{line.rsplit('.', 1)[-1]}-v{seq}"


@dataclass
class _Served:
    """What a LoRA scenario is served by now: ``adapter`` (None: the base) under ``version``."""

    adapter: str | None
    version: str


class SGLangEngine(Engine):
    """An SGLang server at ``url`` serving the model whose tokenizer (and base weights) are in ``model_dir``.

    Args mirror ``engine.*`` (see :class:`~reef_core.config.schema.EngineConfig`); ``version`` names the base weights
    for this process (``<incarnation>:0``); ``weights_dir`` is where releases are written for the server to read
    (the same path must be readable by the server)."""

    dialects = ("openai",)

    def __init__(self, url: str, model_dir: Path, *, version: str, weights_dir: Path, name: str | None = None,
                 timeout_s: float = 300.0, ready_timeout_s: float = 600.0, retry_timeout_s: float | None = None,
                 drain_timeout_s: float = 30.0, max_new_tokens: int = 128, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int | None = None, top_k_logprobs: int = 0,
                 tool_call_parser: str = "none", max_loaded_loras: int = 8, check_logprobs: bool = True,
                 launcher=None):
        if isinstance(top_k_logprobs, bool) or not isinstance(top_k_logprobs, int) or not 0 <= top_k_logprobs <= MAX_K:
            raise ConfigError(f"engine.top_k_logprobs must be an integer from 0 to {MAX_K}, got {top_k_logprobs!r}")
        if max_loaded_loras < 1:
            raise ConfigError(f"engine.max_loaded_loras must be at least 1, got {max_loaded_loras}")
        for key, value in (("timeout_s", timeout_s), ("ready_timeout_s", ready_timeout_s),
                           ("drain_timeout_s", drain_timeout_s)):
            if not value > 0:
                raise ConfigError(f"engine.{key} must be positive, got {value}")
        self.tool_parser = tool_parser(tool_call_parser)
        self.url = url.rstrip("/").removesuffix("/v1")
        self.model_dir = Path(model_dir)
        self.name = name or self.model_dir.name
        self.version = version
        self.weights_dir = Path(weights_dir)
        self.timeout_s = float(timeout_s)
        self.ready_timeout_s = float(ready_timeout_s)
        self.retry_timeout_s = float(retry_timeout_s if retry_timeout_s is not None else timeout_s)
        self.drain_timeout_s = float(drain_timeout_s)
        self.max_new_tokens = int(max_new_tokens)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.seed = seed
        # engine.seed seeds the engine's sampler once (as the embedded engine does): each request without its own
        # seed gets the next seed of this stream, so runs repeat without every request sampling alike.
        self._seeds = random.Random(seed) if seed is not None else None
        self.top_k_logprobs = top_k_logprobs
        self.max_loaded_loras = int(max_loaded_loras)
        self.check_logprobs = check_logprobs
        self.launcher = launcher
        self._client: aiohttp.ClientSession | None = None
        self._proxy = None
        self._tok = None
        self._open: asyncio.Event | None = None  # admission: cleared while a full-weight update publishes
        self._publish: asyncio.Lock | None = None
        self._drained: asyncio.Condition | None = None
        self._in_flight = 0
        self._leases: Counter[str] = Counter()  # adapter name -> requests using it now
        self._served: dict[str, _Served] = {}  # scenario -> what serves it
        self._scenario_of: dict[str, str] = {}  # every LoRA version -> its scenario
        self._loaded: OrderedDict[str, Path] = OrderedDict()  # adapters loaded on the server, LRU order
        self._dirs: dict[str, Path] = {}  # adapter name -> its PEFT directory (to reload after eviction)
        self._retiring: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self._full_dirs: list[Path] = []
        #: Counters: native generations, passthrough calls, retries of aborted requests, publishes.
        self.stats = {"native": 0, "passthrough": 0, "retries": 0, "publishes": 0, "adapter_loads": 0,
                      "adapter_unloads": 0}

    # ---- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._client is not None:
            return
        from reef_core.engines.upstream import UpstreamEngine

        if self.launcher is not None:
            await asyncio.to_thread(self.launcher.start)
        self._open, self._publish, self._drained = asyncio.Event(), asyncio.Lock(), asyncio.Condition()
        self._open.set()
        # One pooled session; a whole non-streamed call is bounded by asyncio.timeout in _send, each stream read by
        # sock_read (as UpstreamEngine does).
        self._client = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=min(10.0, self.timeout_s),
                                          sock_read=self.timeout_s),
            trust_env=False, cookie_jar=aiohttp.DummyCookieJar())
        self._proxy = UpstreamEngine(self.url, dialect="openai", timeout_s=self.timeout_s, name=self.name,
                                     trust_env=False)
        try:
            await self._proxy.start()
            await self._wait_ready()
            self._tok = await asyncio.to_thread(_load_tokenizer, self.model_dir)
            if self.check_logprobs:
                await self._check_original_logprobs()
            await self._label_base()
            await self._unload_leftovers()
            self.weights_dir.mkdir(parents=True, exist_ok=True)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        client, self._client = self._client, None
        if client is not None:
            await client.close()
        if self._proxy is not None:
            await self._proxy.close()
            self._proxy = None
        if self.launcher is not None:
            await asyncio.to_thread(self.launcher.stop)

    def model_ids(self) -> list[str]:
        return [self.name]

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        last = "no answer"
        while True:
            if self.launcher is not None:
                self.launcher.check_alive()
            try:
                status, _raw = await self._send("GET", "/health", timeout=min(10.0, self.timeout_s))
                if status == 200:
                    return
                last = f"HTTP {status}"
            except UpstreamError as exc:
                last = exc.message
            if time.monotonic() > deadline:
                raise UpstreamError(f"SGLang server at {self.url} was not ready within {self.ready_timeout_s:g} s "
                                    f"(engine.ready_timeout_s): {last}")
            await asyncio.sleep(0.2)

    async def _check_original_logprobs(self) -> None:
        """Refuse a server whose log-probs follow the request's temperature (see the module docstring)."""
        ids = await asyncio.to_thread(self._prompt_ids, [{"role": "user", "content": "Hello"}], None)
        tops = []
        for temperature in (1.0, 0.5):
            out = await self._call("/generate", {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 5,
                                                 "sampling_params": {"max_new_tokens": 1, "temperature": temperature}})
            tops.append({int(i): float(lp) for lp, i, *_ in out["meta_info"]["output_top_logprobs"][0]})
        same = tops[0].keys() == tops[1].keys() and all(abs(tops[0][k] - tops[1][k]) < 1e-3 for k in tops[0])
        if not same:
            raise ConfigError(f"the SGLang server at {self.url} returns log-probs at the request's temperature; Reef "
                              "records temperature-1 log-probs for training: start it with "
                              "SGLANG_RETURN_ORIGINAL_LOGPROB=1 (engine.launch sets it)")

    async def _label_base(self) -> None:
        served = (await self._get("/model_info")).get("weight_version")
        if isinstance(served, str) and ":" in served and not served.endswith(":0"):
            # An earlier Reef process published a release into this server: serve the base again.
            log.info("SGLang serves %s left by an earlier Reef process; reloading the base from %s", served,
                     self.model_dir)
            await self._update_from_disk(self.model_dir, self.version)
        else:
            await self._call("/update_weight_version", {"new_version": self.version, "abort_all_requests": False})

    async def _unload_leftovers(self) -> None:
        try:
            cards = (await self._get("/v1/models")).get("data") or []
        except UpstreamError:
            return
        for card in cards:
            name = card.get("id") if isinstance(card, dict) else None
            if isinstance(name, str) and ADAPTER_NAME.match(name):
                await self._call("/unload_lora_adapter", {"lora_name": name}, check=False)

    # ---- HTTP --------------------------------------------------------------------------------------------
    def _http(self) -> aiohttp.ClientSession:
        if self._client is None:
            raise UpstreamError(f"engine {self.name} is not started")
        return self._client

    async def _send(self, method: str, path: str, body: dict | None = None, *,
                    timeout: float | None = None) -> tuple[int, bytes]:
        """One whole call: ``(status, body bytes)``; UpstreamTimeout / UpstreamError when it cannot be made."""
        limit = self.timeout_s if timeout is None else timeout
        try:
            async with asyncio.timeout(limit):
                async with self._http().request(method, self.url + path, json=body) as resp:
                    return resp.status, await resp.read()
        except TimeoutError as exc:
            raise UpstreamTimeout(f"SGLang {path} did not answer within {limit:g} s") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"SGLang {path} failed: {type(exc).__name__}: {exc}") from exc

    async def _get(self, path: str) -> dict:
        status, raw = await self._send("GET", path)
        if status != 200:
            raise UpstreamError(f"SGLang {path} answered {status}: {raw[:300].decode('utf-8', 'replace')}")
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise UpstreamError(f"SGLang {path} answered invalid JSON") from exc

    async def _call(self, path: str, body: dict, *, check: bool = True) -> dict:
        """POST a JSON body; the parsed answer. Non-2xx answers raise (``check``) with the server's message."""
        status, raw = await self._send("POST", path, body)
        try:
            out = json.loads(raw)
        except ValueError:
            out = {"message": raw[:500].decode("utf-8", "replace")}
        if check and (status >= 300 or (isinstance(out, dict) and out.get("success") is False)):
            message = out.get("message") or out.get("error_message") or out.get("detail") or out.get("error") \
                if isinstance(out, dict) else out
            raise UpstreamError(f"SGLang {path} failed ({status}): {message}", status=status)
        return out if isinstance(out, dict) else {"result": out}

    # ---- requests ----------------------------------------------------------------------------------------
    def _prompt_ids(self, messages: list[dict], tools: list | None) -> list[int]:
        kwargs = {"tools": tools} if tools else {}
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def _sampling(self, body: dict) -> SamplingParams:
        for key in _REFUSED:
            if body.get(key):
                raise ValidationFailed(f"{key} would make the recorded log-probs disagree with the policy; a training "
                                       "scenario does not accept it", param=key)
        fmt = body.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
            raise ValidationFailed("response_format is not supported on a training scenario", param="response_format")
        s = sampling_params(body, max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                            model=self.name, one_choice="a training scenario generates one choice")
        if s.seed is None and self._seeds:
            s = dataclasses.replace(s, seed=self._seeds.getrandbits(63))
        return s

    def _native_body(self, body: dict, prompt_ids: list[int], s: SamplingParams, lora: str | None, stream: bool) -> dict:
        params: dict[str, Any] = {"max_new_tokens": s.max_new, "temperature": s.temperature, "top_p": s.top_p,
                                  "top_k": -1, "min_p": 0.0}
        if s.stops:
            params["stop"] = s.stops
        if s.seed is not None:
            params["sampling_seed"] = s.seed
        out = {"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True, "stream": stream,
               "rid": uuid.uuid4().hex}
        top = max(self.top_k_logprobs, s.top_logprobs if s.logprobs else 0)
        if top:
            out["top_logprobs_num"] = top
        if lora is not None:
            out["lora_path"] = lora
        return out

    def _messages(self, body: dict) -> list[dict]:
        return chat_messages(body, where="a training scenario's message content")

    def _check_started(self) -> None:
        if self._client is None or self._tok is None:
            raise UpstreamError(f"engine {self.name} is not started")

    async def _admit(self, frozen: str | None) -> tuple[str | None, str | None]:
        """Wait for admission (closed while weights publish); take a lease; (adapter name or None, LoRA version or
        None: the base serves, under the server's own weight version)."""
        await self._open.wait()
        scenario = self._scenario_of.get(frozen) if frozen is not None else None
        served = self._served.get(scenario) if scenario is not None else None
        self._in_flight += 1
        if served is None:
            return None, None
        if served.adapter is not None:
            self._leases[served.adapter] += 1
            try:
                await self._ensure_loaded(served.adapter)
            except BaseException:
                await self._release(served.adapter)
                raise
        return served.adapter, served.version

    async def _release(self, adapter: str | None) -> None:
        self._in_flight -= 1
        if adapter is not None:
            self._leases[adapter] -= 1
            if self._leases[adapter] <= 0:
                del self._leases[adapter]
        async with self._drained:
            self._drained.notify_all()

    async def _generate(self, req: EngineRequest, s: SamplingParams, prompt_ids: list[int]):
        """One native generation, retried while the engine aborts it: (answer, the version that produced it)."""
        deadline = time.monotonic() + self.retry_timeout_s
        delay = 0.05
        while True:
            adapter, lora_version = await self._admit(req.version)
            try:
                out = await self._post_generate(self._native_body(req.body, prompt_ids, s, adapter, False))
            finally:
                await self._release(adapter)
            if isinstance(out, EngineResponse):
                return out, None
            finish = (out.get("meta_info") or {}).get("finish_reason") or {}
            if finish.get("type") != "abort":
                return out, lora_version or (out["meta_info"].get("weight_version") or self.version)
            self.stats["retries"] += 1
            if time.monotonic() + delay > deadline:
                raise UpstreamTimeout(f"SGLang kept aborting the request for {self.retry_timeout_s:g} s "
                                      f"(engine.retry_timeout_s): {finish.get('message')}")
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)

    async def _post_generate(self, payload: dict) -> dict | EngineResponse:
        status, raw = await self._send("POST", "/generate", payload)
        if status >= 500:
            raise UpstreamError(f"SGLang /generate answered {status}: {raw[:300].decode('utf-8', 'replace')}",
                                status=status)
        if status >= 400:
            return EngineResponse(relay_status(status),
                                  error_body("openai", status, raw[:2000].decode("utf-8", "replace")))
        try:
            out = json.loads(raw)
        except ValueError as exc:
            raise UpstreamError("SGLang answered invalid JSON") from exc
        if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict):
            raise UpstreamError("SGLang /generate answer has no meta_info")
        return out

    def _tokens(self, out: dict, prompt_ids: list[int], version: str) -> TokenData:
        meta = out["meta_info"]
        triples = meta.get("output_token_logprobs")
        ids = out.get("output_ids")
        if not isinstance(triples, list) or not isinstance(ids, list) or len(triples) != len(ids):
            raise UpstreamError("SGLang answer lacks per-token log-probs for its output ids")
        if any(int(t[1]) != i for t, i in zip(triples, ids)):
            raise UpstreamError("SGLang log-probs name other tokens than its output ids")
        top = None
        if self.top_k_logprobs:
            rows = meta.get("output_top_logprobs")
            if not isinstance(rows, list) or len(rows) != len(ids):
                raise UpstreamError("SGLang answer lacks top log-probs for every output token")
            k = min(self.top_k_logprobs, min((len(r) for r in rows), default=self.top_k_logprobs))
            top_ids, top_lps = [], []
            for row in rows:
                for lp, tid, *_ in row[:k]:
                    top_ids.append(int(tid))
                    top_lps.append(float(lp))
            top = TopK(k=max(k, 1), ids=top_ids, logprobs=top_lps) if k else None
        return TokenData(list(prompt_ids), [int(i) for i in ids], [float(t[0]) for t in triples], version, top)

    def _choice(self, text: str, finish: dict, body: dict) -> tuple[dict, str]:
        """The assistant message and OpenAI finish reason for ``text`` (tool calls parsed when tools were given)."""
        reason = "length" if finish.get("type") == "length" else "stop"
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None, "annotations": []}
        if body.get("tools") and self.tool_parser is not None:
            content, calls = parse_tool_calls(self.tool_parser, text)
            if calls:
                message["content"] = content or None
                message["tool_calls"] = calls
                reason = "tool_calls"
        return message, reason

    def _logprob_entries(self, out: dict, s: SamplingParams) -> dict | None:
        if not s.logprobs:
            return None
        meta = out["meta_info"]
        rows = meta.get("output_top_logprobs") or [[] for _ in out["output_ids"]]
        entries = []
        for (lp, tid, *_), row in zip(meta["output_token_logprobs"], rows):
            entries.append({**self._lp_item(int(tid), float(lp)),
                            "top_logprobs": [self._lp_item(int(i), float(v)) for v, i, *_ in row[:s.top_logprobs]]})
        return {"content": entries, "refusal": None}

    def _lp_item(self, tid: int, lp: float) -> dict:
        token = self._tok.decode([tid])
        return {"token": token, "logprob": lp, "bytes": list(token.encode("utf-8"))}

    async def complete(self, req: EngineRequest) -> EngineResponse:
        self.check_dialect(req)
        self._check_started()
        if req.route == "count_tokens":
            return await self.count_tokens(req)
        if not req.tokens:
            self.stats["passthrough"] += 1
            return await self._proxy.complete(req)
        s = self._sampling(req.body)
        prompt_ids = await asyncio.to_thread(self._prompt_ids, self._messages(req.body), req.body.get("tools"))
        out, version = await self._generate(req, s, prompt_ids)
        if isinstance(out, EngineResponse):
            return out
        self.stats["native"] += 1
        tokens = self._tokens(out, prompt_ids, version)
        message, reason = self._choice(out.get("text") or "", out["meta_info"]["finish_reason"], req.body)
        body = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": s.model, "system_fingerprint": f"reef-{version}",
                "choices": [{"index": 0, "message": message, "logprobs": self._logprob_entries(out, s),
                             "finish_reason": reason}],
                "usage": _usage(tokens)}
        return EngineResponse(200, body, {}, tokens=tokens, version=version)

    async def stream(self, req: EngineRequest) -> AsyncIterator[StreamEvent]:
        self.check_dialect(req)
        self._check_started()
        if not req.tokens:
            self.stats["passthrough"] += 1
            async for ev in self._proxy.stream(req):
                yield ev
            return
        s = self._sampling(req.body)
        prompt_ids = await asyncio.to_thread(self._prompt_ids, self._messages(req.body), req.body.get("tools"))
        buffer_text = bool(req.body.get("tools")) and self.tool_parser is not None  # calls parsed from the whole text
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": s.model}

        def chunk(delta: dict, finish: str | None = None, lps: dict | None = None, fp: str | None = None):
            return StreamEvent(None, dict(base, system_fingerprint=fp, choices=[
                {"index": 0, "delta": delta, "logprobs": lps, "finish_reason": finish}]))

        deadline = time.monotonic() + self.retry_timeout_s
        delay = 0.05
        while True:
            adapter, lora_version = await self._admit(req.version)
            sent_any = False
            final = None
            try:
                sent_text, sent_tokens = "", 0
                async for state in self._stream_generate(self._native_body(req.body, prompt_ids, s, adapter, True)):
                    meta = state["meta_info"]
                    finish = meta.get("finish_reason")
                    if finish and finish.get("type") == "abort":
                        final = state
                        break
                    version = lora_version or meta.get("weight_version") or self.version
                    if not sent_any:
                        yield chunk({"role": "assistant", "content": ""}, fp=f"reef-{version}")
                        sent_any = True
                    text = state.get("text") or ""
                    if not buffer_text and len(text) > len(sent_text) and text.startswith(sent_text):
                        lps = None
                        if s.logprobs:
                            entries = self._logprob_entries(state, s)["content"]
                            lps = {"content": entries[sent_tokens:], "refusal": None}
                            sent_tokens = len(entries)
                        yield chunk({"content": text[len(sent_text):]}, lps=lps, fp=f"reef-{version}")
                        sent_text = text
                    final = state
            finally:
                await self._release(adapter)
            if final is None:
                raise UpstreamError("SGLang stream ended without a result")
            finish = final["meta_info"].get("finish_reason") or {}
            if finish.get("type") == "abort":
                if sent_any:
                    raise UpstreamError(f"SGLang aborted the request mid-stream: {finish.get('message')}")
                self.stats["retries"] += 1
                if time.monotonic() + delay > deadline:
                    raise UpstreamTimeout(f"SGLang kept aborting the request for {self.retry_timeout_s:g} s "
                                          f"(engine.retry_timeout_s)")
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)
                continue
            break
        self.stats["native"] += 1
        version = lora_version or final["meta_info"].get("weight_version") or self.version
        tokens = self._tokens(final, prompt_ids, version)
        fp = f"reef-{version}"
        if not sent_any:
            yield chunk({"role": "assistant", "content": ""}, fp=fp)
        message, reason = self._choice(final.get("text") or "", finish, req.body)
        if buffer_text:
            delta = {"content": message["content"]} if message.get("content") else {}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            if delta:
                yield chunk(delta, fp=fp)
        yield chunk({}, reason, fp=fp)
        if s.include_usage:
            yield StreamEvent(None, dict(base, system_fingerprint=fp, choices=[], usage=_usage(tokens)))
        yield StreamEvent(TOKENS_EVENT, tokens.to_event())
        yield StreamEvent(None, "[DONE]")

    async def _stream_generate(self, payload: dict) -> AsyncIterator[dict]:
        """SGLang's cumulative stream: each yielded dict is the whole answer so far."""
        try:
            async with self._http().post(self.url + "/generate", json=payload) as resp:
                if resp.status >= 400:
                    raw = (await resp.read())[:500].decode("utf-8", "replace")
                    raise UpstreamError(f"SGLang /generate answered {resp.status}: {raw}", status=resp.status)
                decoder = SSEDecoder()
                async for chunk in resp.content.iter_any():
                    for _name, data in decoder.feed(chunk):
                        if data == "[DONE]":
                            return
                        try:
                            state = json.loads(data)
                        except ValueError as exc:
                            raise UpstreamError("SGLang stream carried invalid JSON") from exc
                        if isinstance(state, dict) and state.get("error"):
                            raise UpstreamError(f"SGLang stream error: {state['error']}")
                        if not isinstance(state, dict) or not isinstance(state.get("meta_info"), dict):
                            raise UpstreamError("SGLang stream chunk has no meta_info")
                        yield state
                raise UpstreamError("stream ended early")
        except TimeoutError as exc:
            raise UpstreamTimeout(f"SGLang stream stalled for {self.timeout_s:g} s") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"SGLang connection failed: {type(exc).__name__}: {exc}") from exc

    async def count_tokens(self, req: EngineRequest) -> EngineResponse:
        """Exact: the prompt rendered with the model's chat template and tokenizer."""
        self._check_started()
        body = anthropic_count_tokens_to_openai(req.body) if req.dialect == "anthropic" else req.body
        n = len(await asyncio.to_thread(self._prompt_ids, self._messages(body), body.get("tools")))
        return EngineResponse(200, {"input_tokens": n}, {}, version=self.version)

    # ---- full weights ------------------------------------------------------------------------------------
    async def swap_weights(self, version: str, state_dict: dict | None = None) -> None:
        """Serve ``version`` (``state_dict``: the tensors that changed, None: relabel only); see the module
        docstring. On failure the previous weights keep serving and this raises."""
        version = str(version)
        async with self._publish:
            if state_dict is not None and any(s.adapter is not None for s in self._served.values()):
                raise Conflict(f"engine {self.name} serves LoRA adapters on its base weights; a full-weight swap "
                               "would move the base under every one of them")
            path = None
            if state_dict is not None:
                path = await asyncio.to_thread(self._write_full, version, state_dict)
            await self._paused_update(path, version)
            self.version = version
            self.stats["publishes"] += 1
            if path is not None:
                self._full_dirs.append(path)
                while len(self._full_dirs) > 2:  # the serving release and the one before it
                    shutil.rmtree(self._full_dirs.pop(0), ignore_errors=True)

    async def _paused_update(self, path: Path | None, version: str) -> None:
        """Close admission, drain, pause, load (or relabel), verify the served version, resume."""
        self._open.clear()
        try:
            drained = await self._drain()
            await self._call("/pause_generation", {"mode": "in_place" if drained else "abort"})
            try:
                if path is None:
                    await self._call("/update_weight_version", {"new_version": version, "abort_all_requests": False})
                else:
                    await self._update_from_disk(path, version)
            finally:
                await self._call("/continue_generation", {}, check=False)
        finally:
            self._open.set()

    async def _update_from_disk(self, path: Path, version: str) -> None:
        await self._call("/update_weights_from_disk", {"model_path": str(path), "weight_version": version,
                                                        "flush_cache": True})
        served = (await self._get("/model_info")).get("weight_version")
        if served != version:
            raise UpstreamError(f"SGLang reports weight version {served!r} after loading {version!r}")

    async def _drain(self) -> bool:
        """Wait until no request of Reef's is in flight; False when ``engine.drain_timeout_s`` passed first."""
        try:
            async with asyncio.timeout(self.drain_timeout_s):
                async with self._drained:
                    await self._drained.wait_for(lambda: self._in_flight == 0)
            return True
        except TimeoutError:
            return False

    def _write_full(self, version: str, state_dict: dict) -> Path:
        """An HF directory: the base model's files, its safetensors tensors replaced by ``state_dict``'s."""
        from safetensors.torch import load_file, save_file

        target = self.weights_dir / "full" / _safe(version)
        tmp = target.with_name(target.name + f".tmp-{uuid.uuid4().hex[:6]}")
        tmp.mkdir(parents=True)
        try:
            tensors: dict = {}
            for f in sorted(self.model_dir.iterdir()):
                if f.is_file() and f.suffix == ".safetensors":
                    tensors.update(load_file(str(f)))
                elif f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _WEIGHT_INDEXES:
                    shutil.copy2(f, tmp / f.name)
            if not tensors:
                raise ConfigError(f"engine.model {self.model_dir} holds no safetensors weights to publish over")
            for key, value in state_dict.items():
                if key in tensors:  # keys the files lack are tied to one they hold (lm_head -> embeddings)
                    tensors[key] = value.detach().to("cpu", tensors[key].dtype).contiguous()
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return target

    # ---- adapters ----------------------------------------------------------------------------------------
    async def load_adapter(self, name: str, version: str, adapter: AdapterWeights | None) -> None:
        """Serve scenario ``name``'s requests with ``adapter`` (None: the base) as ``version`` from now on.

        The adapter is loaded under a new versioned name before anything switches; the one it replaces is unloaded
        once its in-flight requests are done."""
        name, version = str(name), str(version)
        async with self._publish:
            new = None
            if adapter is not None:
                new = adapter_name(version)
                path = await asyncio.to_thread(self._write_adapter, new, adapter)
                await self._load(new, path)
            old = self._served.get(name)
            self._served[name] = _Served(new, version)
            self._scenario_of[version] = name
            if old is not None and old.adapter is not None and old.adapter != new:
                self._retire(old.adapter)
            await self._bound_residency()

    async def drop_adapter(self, name: str) -> None:
        """Forget scenario ``name``'s adapter: its requests are served by the base."""
        async with self._publish:
            old = self._served.pop(str(name), None)
            for version in [v for v, n in self._scenario_of.items() if n == name]:
                del self._scenario_of[version]
            if old is not None and old.adapter is not None:
                self._retire(old.adapter)

    def adapters(self) -> dict[str, str]:
        """Scenario -> the version serving it."""
        return {name: s.version for name, s in self._served.items()}

    def adapter_names(self) -> dict[str, str | None]:
        """Scenario -> the SGLang adapter name its requests carry (None: the base)."""
        return {name: s.adapter for name, s in self._served.items()}

    def _write_adapter(self, name: str, adapter: AdapterWeights) -> Path:
        from safetensors.torch import save_file

        target = self.weights_dir / "adapters" / name
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        (target / "adapter_config.json").write_text(json.dumps(adapter.config, indent=1))
        save_file({k: v.detach().to("cpu").contiguous() for k, v in adapter.tensors.items()},
                  str(target / "adapter_model.safetensors"), metadata={"format": "pt"})
        return target

    async def _load(self, name: str, path: Path) -> None:
        await self._call("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        self._loaded[name] = path
        self._dirs[name] = path
        self.stats["adapter_loads"] += 1

    async def _unload(self, name: str) -> None:
        self._loaded.pop(name, None)
        await self._call("/unload_lora_adapter", {"lora_name": name}, check=False)
        self.stats["adapter_unloads"] += 1

    async def _ensure_loaded(self, name: str) -> None:
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return
        async with self._publish:  # reloading one Reef unloaded for the residency bound
            if name not in self._loaded:
                await self._load(name, self._dirs[name])
                await self._bound_residency()

    async def _bound_residency(self) -> None:
        """Unload least recently used idle adapters while more than ``engine.max_loaded_loras`` are loaded."""
        for name in list(self._loaded):
            if len(self._loaded) <= self.max_loaded_loras:
                return
            if self._leases.get(name, 0) == 0 and name not in self._retiring:
                await self._unload(name)

    def _retire(self, name: str) -> None:
        """Unload adapter ``name`` once the requests using it are done (in the background)."""
        self._retiring.add(name)

        async def retire() -> None:
            try:
                async with self._drained:
                    await self._drained.wait_for(lambda: self._leases.get(name, 0) == 0)
                async with self._publish:
                    if not any(s.adapter == name for s in self._served.values()):
                        await self._unload(name)
                        self._dirs.pop(name, None)
                        shutil.rmtree(self.weights_dir / "adapters" / name, ignore_errors=True)
            except ReefError as exc:
                log.warning("unloading adapter %s failed: %s", name, exc.message)
            finally:
                self._retiring.discard(name)

        task = asyncio.get_running_loop().create_task(retire())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settled(self) -> None:
        """Wait until every retired adapter has been unloaded (tests, benchmarks)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def _usage(tokens: TokenData) -> dict:
    n, m = len(tokens.prompt_ids), len(tokens.output_ids)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def _safe(version: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", version)


def _load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"engine.model {model_dir}: the tokenizer has no chat template to render prompts with")
    return tok
