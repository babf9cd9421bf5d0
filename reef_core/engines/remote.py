"""RemoteEngine: what every HTTP serving engine (SGLang, vLLM) shares, whatever its wire protocol.

Reef never imports the serving stack: the server runs in its own environment (``engine.url``) and a subclass of
:class:`RemoteEngine` is its HTTP client. The subclass speaks the server's protocol (which route generates from token
ids, how log-probs come back, how weights and adapters are loaded, how generation pauses); everything else lives
here, once:

* **Two paths per request** (``EngineRequest.tokens``). Training scenarios: Reef renders the chat template with the
  model's own tokenizer (``engine.model``), the subclass generates from those ids with explicit sampling parameters
  and per-token log-probs (top-K with ``engine.top_k_logprobs``), and the answer becomes :class:`TokenData` stamped
  with the version that produced it; the client gets an OpenAI body, plain or streamed, tool calls parsed with
  ``engine.tool_call_parser``. Record-only and harness scenarios pass unchanged through the server's
  OpenAI-compatible ``/v1/chat/completions`` (:class:`~reef_core.engines.upstream.UpstreamEngine`).
* **Retry with a deadline**: requests the server aborted (e.g. during an update) are retried with backoff (0.05 s
  doubling to 1 s) until ``engine.retry_timeout_s``, then fail with :class:`UpstreamTimeout`. A stream aborted after
  it relayed text cannot be replayed: it ends with an :class:`UpstreamError` (stored as incomplete, never trained).
* **Admission and drain**: a full-weight publish closes admission, waits up to ``engine.drain_timeout_s`` for
  Reef's in-flight requests, then lets the subclass pause the server, load and verify, and resume; any failure
  raises with the previous release still serving. Releases are written as HF safetensors directories under
  ``engine.weights_dir`` (the base model's files with the changed tensors).
* **Versioned adapters**: a LoRA release is written as a PEFT directory and loaded under ``<scenario-key>-v<seq>``,
  never in place; the adapter it replaces is unloaded once its in-flight requests are done;
  ``engine.max_loaded_loras`` bounds the adapters Reef keeps loaded (the least recently used idle one is unloaded,
  reloaded from its directory when next needed).
* **Start-up**: waits for readiness (``engine.ready_timeout_s``), checks that log-probs are temperature-1, labels
  the served weights with this process's base version (reloading the base when an earlier Reef process left a
  release loaded) and unloads adapters an earlier Reef process left behind, so restart recovery reloads current
  releases.

Every generation the subclass returns is a :class:`Generation` (cumulative, for streams too).
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

from reef_core.models.adapter import AdapterWeights
from reef_core.wire import TOKEN_COUNT_HEADER
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
from reef_core.engines.toolcalls import finish_reason, parse_tool_calls, resolve_parser, tool_parser
from reef_core.topk import MAX_K, TopK
from reef_core.engines.translate import anthropic_count_tokens_to_openai, error_body
from reef_core.engines.staging import check_readable, staged_dir
from reef_core.engines.untie import tie_in_release
from reef_core.errors import ConfigError, Conflict, ReefError, UpstreamError, UpstreamTimeout, ValidationFailed
from reef_core.versions import ServedVersion

log = logging.getLogger("reef.engines.remote")

#: Names Reef gives adapters (``<8 hex key>-v<seq>``): what a restarted Reef unloads as left over.
ADAPTER_NAME = re.compile(r"^[0-9a-f]{8}-v\d+$")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
#: Body fields a training request may not carry: each would make the recorded log-probs disagree with the policy.
_REFUSED = ("logit_bias", "presence_penalty", "frequency_penalty")


def adapter_name(version: str) -> str:
    """The server-side adapter name of a LoRA version ``<incarnation>.<key>:<seq>``: ``<key>-v<seq>``."""
    served = ServedVersion.read(version)
    return f"{served.incarnation.rsplit('.', 1)[-1]}-v{served.seq}"


@dataclass
class _Served:
    """What a LoRA scenario is served by now: ``adapter`` (None: the base) under ``version``."""

    adapter: str | None
    version: str


@dataclass
class Generation:
    """One generation as far as it went, in protocol-neutral form.

    ``top[t]`` lists output token ``t``'s most likely ``(id, log-prob)`` pairs, best first (None: not asked for);
    ``finish`` is ``length`` / ``stop`` / ``abort``, None while a stream runs; ``version`` the weight version the
    server reports for it (None: the server reports none, the admitted version stands)."""

    text: str
    output_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None = None
    finish: str | None = None
    message: str | None = None
    version: str | None = None


@dataclass(frozen=True)
class RemoteOptions:
    """:class:`RemoteEngine`'s tunables: the ``engine.*`` keys of the same names (typed by
    :class:`~reef_core.config.schema.EngineConfig`; the ranges it cannot say are checked here).
    ``retry_timeout_s=None`` retries until ``timeout_s``."""

    timeout_s: float = 300.0
    ready_timeout_s: float = 600.0
    retry_timeout_s: float | None = None
    drain_timeout_s: float = 30.0
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    top_k_logprobs: int = 0
    tool_call_parser: str = "none"
    max_loaded_loras: int = 8
    check_logprobs: bool = True

    def __post_init__(self) -> None:
        for key in ("timeout_s", "ready_timeout_s", "drain_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"engine.{key} must be positive, got {getattr(self, key)}")
        if self.retry_timeout_s is not None and not self.retry_timeout_s > 0:
            raise ConfigError(f"engine.retry_timeout_s must be positive, got {self.retry_timeout_s}")
        if not 0 <= self.top_k_logprobs <= MAX_K:
            raise ConfigError(f"engine.top_k_logprobs must be an integer from 0 to {MAX_K}, "
                              f"got {self.top_k_logprobs!r}")
        if self.max_loaded_loras < 1:
            raise ConfigError(f"engine.max_loaded_loras must be at least 1, got {self.max_loaded_loras}")
        tool_parser(self.tool_call_parser)


class RemoteEngine(Engine):
    """A serving engine at ``url`` serving the model whose tokenizer (and base weights) are in ``model_dir``.

    ``options`` are its tunables (:class:`RemoteOptions`, ``engine.*``); ``version`` names the base weights for this
    process (``<incarnation>:0``); ``weights_dir`` is where releases are written for the server to read (the same
    path must be readable by the server). Subclasses set ``protocol`` (the server's name in messages) and implement
    the hooks below."""

    dialects = ("openai",)
    protocol = "server"

    def __init__(self, url: str, model_dir: Path, *, version: str, weights_dir: Path, name: str | None = None,
                 options: RemoteOptions = RemoteOptions(), launcher=None):
        self.options = options
        self.tool_call_parser = options.tool_call_parser
        self.tool_parser: str | None = None  # resolved against the tokenizer's chat template at start
        self.url = url.rstrip("/").removesuffix("/v1")
        # Absolute: the server resolves a relative path against its own working directory, not Reef's.
        self.model_dir = Path(model_dir).expanduser().absolute()
        self.name = name or self.model_dir.name
        self.version = version
        self.weights_dir = Path(weights_dir).expanduser().absolute()
        #: The served model's files that full-weight releases are written over (a subclass may serve a copy).
        self.release_base = self.model_dir
        self.timeout_s = float(options.timeout_s)
        self.ready_timeout_s = float(options.ready_timeout_s)
        retry = options.retry_timeout_s
        self.retry_timeout_s = float(retry if retry is not None else options.timeout_s)
        self.drain_timeout_s = float(options.drain_timeout_s)
        self.max_new_tokens = int(options.max_new_tokens)
        self.temperature = float(options.temperature)
        self.top_p = float(options.top_p)
        self.seed = options.seed
        # engine.seed seeds the engine's sampler once (as the embedded engine does): each request without its own
        # seed gets the next seed of this stream, so runs repeat without every request sampling alike.
        self._seeds = random.Random(options.seed) if options.seed is not None else None
        self.top_k_logprobs = options.top_k_logprobs
        self.max_loaded_loras = int(options.max_loaded_loras)
        self.check_logprobs = options.check_logprobs
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

    # ---- protocol hooks (subclasses) -----------------------------------------------------------------------
    async def _after_ready(self) -> None:
        """Read what the server reports about itself once it answers (default: nothing)."""

    async def _check_original_logprobs(self) -> None:
        """Refuse a server whose log-probs follow the request's temperature (ConfigError naming the fix)."""
        raise NotImplementedError

    async def _label_base(self) -> None:
        """Label the served weights ``self.version``, reloading the base first when a Reef release is loaded."""
        raise NotImplementedError

    async def _paused_update(self, path: Path | None, version: str) -> None:
        """Pause the server (in-flight requests drained: ``self._drain()``), load ``path`` (None: relabel only) under
        ``version``, verify the served version, resume; raise with the old weights serving on failure."""
        raise NotImplementedError

    async def _load_remote(self, name: str, path: Path) -> None:
        raise NotImplementedError

    async def _unload_remote(self, name: str) -> None:
        """Unload adapter ``name``; failures are not raised (an adapter the server lacks is already gone)."""
        raise NotImplementedError

    def _native_body(self, prompt_ids: list[int], s: SamplingParams, top: int, adapter: str | None,
                     stream: bool) -> dict:
        raise NotImplementedError

    async def _generate_once(self, payload: dict) -> Generation | EngineResponse:
        """One whole native generation; an EngineResponse for a 4xx the client should see."""
        raise NotImplementedError

    def _stream_once(self, payload: dict) -> AsyncIterator[Generation]:
        """One native stream, as cumulative generations (the last one finished)."""
        raise NotImplementedError

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
            await self._after_ready()
            self._tok = await asyncio.to_thread(_load_tokenizer, self.model_dir)
            self.tool_parser = resolve_parser(self.tool_call_parser, self._tok.chat_template)
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
                raise UpstreamError(f"{self.protocol} server at {self.url} was not ready within "
                                    f"{self.ready_timeout_s:g} s (engine.ready_timeout_s): {last}")
            await asyncio.sleep(0.2)

    async def _unload_leftovers(self) -> None:
        try:
            cards = (await self._get("/v1/models")).get("data") or []
        except UpstreamError:
            return
        for card in cards:
            name = card.get("id") if isinstance(card, dict) else None
            if isinstance(name, str) and ADAPTER_NAME.match(name):
                await self._unload_remote(name)

    def _temperature_probe_differs(self, tops: list[dict[int, float]]) -> bool:
        """Whether two probes' top log-probs (temperature 1 and 0.5) differ, i.e. follow the temperature."""
        return not (tops[0].keys() == tops[1].keys() and all(abs(tops[0][k] - tops[1][k]) < 1e-3 for k in tops[0]))

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
            raise UpstreamTimeout(f"{self.protocol} {path} did not answer within {limit:g} s") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"{self.protocol} {path} failed: {type(exc).__name__}: {exc}") from exc

    async def _get(self, path: str) -> dict:
        status, raw = await self._send("GET", path)
        if status != 200:
            raise UpstreamError(f"{self.protocol} {path} answered {status}: {raw[:300].decode('utf-8', 'replace')}",
                                status=status)
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise UpstreamError(f"{self.protocol} {path} answered invalid JSON") from exc

    async def _call(self, path: str, body: dict | None, *, check: bool = True) -> dict:
        """POST a JSON body; the parsed answer (a non-JSON answer as ``{"message": text}``). Non-2xx answers (and
        ``success: false``) raise when ``check``, with the server's message."""
        status, raw = await self._send("POST", path, body)
        try:
            out = json.loads(raw) if raw else {}
        except ValueError:
            out = {"message": raw[:500].decode("utf-8", "replace")}
        if check and (status >= 300 or (isinstance(out, dict) and out.get("success") is False)):
            message = _error_message(out)
            raise UpstreamError(f"{self.protocol} {path} failed ({status}): {message}", status=status)
        return out if isinstance(out, dict) else {"result": out}

    async def _post_json(self, path: str, payload: dict) -> dict | EngineResponse:
        """A generation call: the answer, an EngineResponse for a 4xx (relayed), UpstreamError for a 5xx."""
        status, raw = await self._send("POST", path, payload)
        if status >= 500:
            raise UpstreamError(f"{self.protocol} {path} answered {status}: {raw[:300].decode('utf-8', 'replace')}",
                                status=status)
        if status >= 400:
            return EngineResponse(relay_status(status),
                                  error_body("openai", status, raw[:2000].decode("utf-8", "replace")))
        try:
            out = json.loads(raw)
        except ValueError as exc:
            raise UpstreamError(f"{self.protocol} answered invalid JSON") from exc
        if not isinstance(out, dict):
            raise UpstreamError(f"{self.protocol} {path} answered something other than an object")
        return out

    async def _sse_json(self, path: str, payload: dict) -> AsyncIterator[dict]:
        """The JSON objects of an SSE stream, until ``[DONE]``; an ``error`` object raises."""
        try:
            async with self._http().post(self.url + path, json=payload) as resp:
                if resp.status >= 400:
                    raw = (await resp.read())[:500].decode("utf-8", "replace")
                    raise UpstreamError(f"{self.protocol} {path} answered {resp.status}: {raw}", status=resp.status)
                decoder = SSEDecoder()
                async for chunk in resp.content.iter_any():
                    for _name, data in decoder.feed(chunk):
                        if data == "[DONE]":
                            return
                        try:
                            state = json.loads(data)
                        except ValueError as exc:
                            raise UpstreamError(f"{self.protocol} stream carried invalid JSON") from exc
                        if isinstance(state, dict) and state.get("error"):
                            raise UpstreamError(f"{self.protocol} stream error: {_error_message(state)}")
                        if not isinstance(state, dict):
                            raise UpstreamError(f"{self.protocol} stream chunk is not an object")
                        yield state
                raise UpstreamError("stream ended early")
        except TimeoutError as exc:
            raise UpstreamTimeout(f"{self.protocol} stream stalled for {self.timeout_s:g} s") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"{self.protocol} connection failed: {type(exc).__name__}: {exc}") from exc

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

    def _top_wanted(self, s: SamplingParams) -> int:
        return max(self.top_k_logprobs, s.top_logprobs if s.logprobs else 0)

    def _messages(self, body: dict) -> list[dict]:
        return chat_messages(body, where="a training scenario's message content")

    def _check_started(self) -> None:
        if self._client is None or self._tok is None:
            raise UpstreamError(f"engine {self.name} is not started")

    async def _admit(self, frozen: str | None) -> tuple[str | None, str, bool]:
        """Wait for admission (closed while weights publish); take a lease; (adapter name or None, the version that
        serves, whether it is a LoRA scenario's own: else the base weights' now, which a publish drains this request
        before moving)."""
        await self._open.wait()
        scenario = self._scenario_of.get(frozen) if frozen is not None else None
        served = self._served.get(scenario) if scenario is not None else None
        self._in_flight += 1
        if served is None:
            return None, self.version, False
        if served.adapter is not None:
            self._leases[served.adapter] += 1
            try:
                await self._ensure_loaded(served.adapter)
            except BaseException:
                await self._release(served.adapter)
                raise
        return served.adapter, served.version, True

    async def _release(self, adapter: str | None) -> None:
        self._in_flight -= 1
        if adapter is not None:
            self._leases[adapter] -= 1
            if self._leases[adapter] <= 0:
                del self._leases[adapter]
        async with self._drained:
            self._drained.notify_all()

    async def _backoff(self, deadline: float, delay: float, message: str | None) -> float:
        """Count a retry of an aborted request and wait; UpstreamTimeout past ``deadline``; the next delay."""
        self.stats["retries"] += 1
        if time.monotonic() + delay > deadline:
            raise UpstreamTimeout(f"{self.protocol} kept aborting the request for {self.retry_timeout_s:g} s "
                                  f"(engine.retry_timeout_s): {message}")
        await asyncio.sleep(delay)
        return min(1.0, delay * 2)

    async def _generate(self, req: EngineRequest, s: SamplingParams, prompt_ids: list[int]):
        """One native generation, retried while the server aborts it: (answer, the version that produced it)."""
        deadline = time.monotonic() + self.retry_timeout_s
        delay = 0.05
        while True:
            adapter, admitted, lora = await self._admit(req.version)
            try:
                out = await self._generate_once(self._native_body(prompt_ids, s, self._top_wanted(s), adapter, False))
            finally:
                await self._release(adapter)
            if isinstance(out, EngineResponse):
                return out, None
            if out.finish != "abort":
                return out, admitted if lora else (out.version or admitted)
            delay = await self._backoff(deadline, delay, out.message)

    def _tokens(self, gen: Generation, prompt_ids: list[int], version: str) -> TokenData:
        if len(gen.logprobs) != len(gen.output_ids):
            raise UpstreamError(f"{self.protocol} answer lacks per-token log-probs for its output ids")
        top = None
        if self.top_k_logprobs:
            rows = gen.top
            if not isinstance(rows, list) or len(rows) != len(gen.output_ids):
                raise UpstreamError(f"{self.protocol} answer lacks top log-probs for every output token")
            k = min(self.top_k_logprobs, min((len(r) for r in rows), default=self.top_k_logprobs))
            top_ids, top_lps = [], []
            for row in rows:
                for tid, lp in row[:k]:
                    top_ids.append(int(tid))
                    top_lps.append(float(lp))
            top = TopK(k=max(k, 1), ids=top_ids, logprobs=top_lps) if k else None
        return TokenData(list(prompt_ids), [int(i) for i in gen.output_ids], [float(x) for x in gen.logprobs],
                         version, top)

    def _choice(self, text: str, finish: str | None, body: dict) -> tuple[dict, str]:
        """The assistant message and OpenAI finish reason for ``text`` (tool calls parsed when tools were given)."""
        reason = "length" if finish == "length" else "stop"
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None, "annotations": []}
        if body.get("tools") and self.tool_parser is not None:
            content, calls = parse_tool_calls(self.tool_parser, text)
            if calls:
                message["content"] = content or None
                message["tool_calls"] = calls
                reason = finish_reason(reason, calls)
        return message, reason

    def _logprob_entries(self, gen: Generation, s: SamplingParams) -> dict | None:
        if not s.logprobs:
            return None
        rows = gen.top or [[] for _ in gen.output_ids]
        entries = []
        for tid, lp, row in zip(gen.output_ids, gen.logprobs, rows):
            entries.append({**self._lp_item(int(tid), float(lp)),
                            "top_logprobs": [self._lp_item(int(i), float(v)) for i, v in row[:s.top_logprobs]]})
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
        message, reason = self._choice(out.text, out.finish, req.body)
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
            adapter, admitted, lora = await self._admit(req.version)
            sent_any = False
            final = None
            try:
                sent_text, sent_tokens = "", 0
                payload = self._native_body(prompt_ids, s, self._top_wanted(s), adapter, True)
                async for state in self._stream_once(payload):
                    final = state
                    if state.finish == "abort":
                        break
                    version = admitted if lora else (state.version or admitted)
                    if not sent_any:
                        yield chunk({"role": "assistant", "content": ""}, fp=f"reef-{version}")
                        sent_any = True
                    text = state.text
                    if not buffer_text and len(text) > len(sent_text) and text.startswith(sent_text):
                        lps = None
                        if s.logprobs:
                            entries = self._logprob_entries(state, s)["content"]
                            lps = {"content": entries[sent_tokens:], "refusal": None}
                            sent_tokens = len(entries)
                        yield chunk({"content": text[len(sent_text):]}, lps=lps, fp=f"reef-{version}")
                        sent_text = text
            finally:
                await self._release(adapter)
            if final is None:
                raise UpstreamError(f"{self.protocol} stream ended without a result")
            if final.finish == "abort":
                if sent_any:
                    raise UpstreamError(f"{self.protocol} aborted the request mid-stream: {final.message}")
                delay = await self._backoff(deadline, delay, final.message)
                continue
            break
        self.stats["native"] += 1
        version = admitted if lora else (final.version or admitted)
        tokens = self._tokens(final, prompt_ids, version)
        fp = f"reef-{version}"
        if not sent_any:
            yield chunk({"role": "assistant", "content": ""}, fp=fp)
        message, reason = self._choice(final.text, final.finish, req.body)
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

    async def count_tokens(self, req: EngineRequest) -> EngineResponse:
        """Exact: the prompt rendered with the model's chat template and tokenizer."""
        self._check_started()
        body = anthropic_count_tokens_to_openai(req.body) if req.dialect == "anthropic" else req.body
        n = len(await asyncio.to_thread(self._prompt_ids, self._messages(body), body.get("tools")))
        return EngineResponse(200, {"input_tokens": n}, {TOKEN_COUNT_HEADER: "tokenizer"}, version=self.version)

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
            self._open.clear()
            try:
                await self._paused_update(path, version)
            finally:
                self._open.set()
            self.version = version
            self.stats["publishes"] += 1
            if path is not None:
                self._full_dirs.append(path)
                while len(self._full_dirs) > 2:  # the serving release and the one before it
                    shutil.rmtree(self._full_dirs.pop(0), ignore_errors=True)

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
        with staged_dir(target) as tmp:
            tensors: dict = {}
            for f in sorted(self.release_base.iterdir()):
                if f.is_file() and f.suffix == ".safetensors":
                    tensors.update(load_file(str(f)))
                elif f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _WEIGHT_INDEXES:
                    shutil.copy2(f, tmp / f.name)
            if not tensors:
                raise ConfigError(f"engine.model {self.model_dir} holds no safetensors weights to publish over")
            for key, value in state_dict.items():
                if key in tensors:  # keys the files lack are tied to one they hold (lm_head -> embeddings)
                    if tuple(value.shape) != tuple(tensors[key].shape):
                        # Caught here, not by the server: a reload that fails can take the server down with it.
                        raise UpstreamError(f"release {version}: tensor {key} has shape {tuple(value.shape)}, the "
                                            f"served model's is {tuple(tensors[key].shape)}")
                    tensors[key] = value.detach().to("cpu", tensors[key].dtype).contiguous()
            tie_in_release(self.release_base, tensors)
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            check_readable(tmp / "model.safetensors", {k: tuple(v.shape) for k, v in tensors.items()})
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
        """Scenario -> the server-side adapter name its requests carry (None: the base)."""
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
        await self._load_remote(name, path)
        self._loaded[name] = path
        self._dirs[name] = path
        self.stats["adapter_loads"] += 1

    async def _unload(self, name: str) -> None:
        self._loaded.pop(name, None)
        await self._unload_remote(name)
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


def _error_message(out: Any) -> Any:
    """The message of an error answer in any of the shapes servers use (``message``, ``error.message``, ...)."""
    if not isinstance(out, dict):
        return out
    err = out.get("error")
    if isinstance(err, dict):
        return err.get("message") or err
    return out.get("message") or out.get("error_message") or out.get("detail") or err


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
