"""FakeSGLang: a FAKE SGLang server (not SGLang) backed by a real tiny torch model, for CPU tests only.

Checked against SGLang's source in the search index (sgl-project/sglang; one stored version per file):
``managers/scheduler.py`` @ 0003215cf1464f44b389cd0b18d0b4c56f2a3da6 (``pause_generation``, ``flush_cache``,
``is_fully_idle``), ``managers/scheduler_components/weight_updater.py`` @ 00a2ca2e56d59f0a19186d7a8a58bdda5201023f,
``entrypoints/http_server.py`` @ 0025436eab0556737d615b36a4dd3e1e26e82f3d, ``lora/utils.py`` @
01235a1633d19644d861f3542011bf35aeaee114 and ``lora/lora_config.py`` @ 0ceb81fe4868b3364267a661da67b5d88aa45fc3.
Behaviours taken from there:

* A weight update with ``flush_cache`` (the default) asserts that the flush succeeded, and the flush refuses while
  the scheduler holds any request: running, paused ``in_place``, or ``retract``-ed (retract frees the KV cache but
  moves the requests back to the waiting queue, which the flush counts too). The assertion kills SGLang's
  scheduler; the fake then answers every route with 500 (``/health`` 503) and reports ``crashed``. Only ``abort``
  (which returns once every request has ended) leaves nothing to block the flush. ``/flush_cache`` itself answers
  400 instead.
* ``incremental_streaming_output`` (``--incremental-streaming-output``): each stream chunk carries only the new
  text, ids and log-probs; by default chunks are cumulative.
* ``sampling_seed`` is used only with ``deterministic_inference`` (``--enable-deterministic-inference``; requests
  without one then get 42), else the server's own generator samples; the seed goes into an int32 tensor (int64 in
  newer versions: ``seed_bits``), and one that does not fit kills the scheduler as the tensor constructor raises.
* Paths (``update_weights_from_disk``'s ``model_path``, ``load_lora_adapter``'s ``lora_path``) are resolved against
  the server's own working directory (``cwd``); SGLang treats a path that is not a directory there as a hub id.
* ``/server_info`` (alias ``/get_server_info``, the name before) returns the server arguments.

SGLang serves only on GPUs (see ``ecosystem-notes.md`` §4), so CPU tests drive this stand-in instead. It speaks the
native routes Reef uses with SGLang's JSON shapes (``sglang-protocol-notes.md``), and its token ids and log-probs are
those of a real ``transformers`` model, so a test can recompute them with a forward pass:

* ``POST /generate``: ``input_ids`` (or ``text``), ``sampling_params`` (an unknown key fails the request with a 500,
  as SGLang does), ``return_logprob``, ``top_logprobs_num``, ``lora_path``, ``stream`` (cumulative chunks, then
  ``data: [DONE]``; an error mid-stream is a chunk with an ``error`` field), ``rid``. ``meta_info`` carries
  ``finish_reason`` (``length`` / ``stop`` with ``matched`` / ``abort``), token counts and ``weight_version``.
  Log-probs are ``log_softmax(logits)`` (temperature 1) when the server runs with ``original_logprob`` (SGLang's
  ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``), else at the request's temperature, as SGLang computes them.
* ``GET /health``, ``/health_generate``, ``/model_info`` (alias ``/get_model_info``), ``/server_info``, ``/v1/models``.
* ``POST /update_weights_from_disk`` (reads the ``*.safetensors`` of an HF directory; waits for in-flight requests
  unless paused; ``weight_version`` is only a label), ``/update_weight_version``, ``/pause_generation``
  (``abort`` | ``retract`` | ``in_place``; queued and paused requests wait), ``/continue_generation``,
  ``/flush_cache``, ``/abort_request``.
* ``POST /load_lora_adapter`` (a PEFT directory), ``/unload_lora_adapter``; ``max_loaded_loras`` evicts the least
  recently used adapter and a request naming an evicted one reloads it, as SGLang does.
* ``POST /v1/chat/completions``: the OpenAI-compatible route (chat template, plain and streamed; ``model`` of the form
  ``<served>:<adapter>`` selects an adapter).

Generation runs on one worker thread, one forward pass per step (no KV cache: every step sees the weights current at
that step, so a request paused ``in_place`` across an update finishes on the new weights, as in SGLang), interleaving
the requests in flight like continuous batching.

Faults and test knobs (control routes, or the same methods on the object):

* ``POST /_fake/faults`` with ``{"op": "update_weights_from_disk" | "load_lora_adapter" | "generate", "fail_next": n}``
  fails the next ``n`` calls of that route (weights/adapters: 400 ``success: false``, the old state kept; generate:
  ``"abort": true`` ends it with finish reason ``abort``, else a 500);
* ``POST /_fake/settings`` ``{"token_delay_s": x}`` slows every generation step (to hold a request in flight);
* ``GET /_fake/stats``: version, paused mode, in-flight count, loaded adapters, counters and the last requests.

Run it with :func:`serve_fake_sglang` (thread or subprocess; yields the base URL) or
``python -m reef_core.testing.fake_sglang --model-dir DIR --port N`` (prints ``FAKE_SGLANG <url>``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import sys
import threading
import time
import uuid
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import torch

from reef_core.background import bound_socket, serve_asgi, uvicorn_server
from reef_core.testing.asgi import fake_in_process, read_request

__all__ = ["FakeSGLang", "serve_fake_sglang", "SAMPLING_KEYS"]

#: ``sampling_params`` keys SGLang accepts (any other fails the request).
SAMPLING_KEYS = frozenset({
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "n", "json_schema", "regex", "ebnf", "custom_params",
    "stream_interval", "sampling_seed", "logit_bias",
})
_GENERATE_KEYS = frozenset({"text", "input_ids", "sampling_params", "return_logprob", "top_logprobs_num",
                            "logprob_start_len", "return_text_in_logprobs", "stream", "lora_path", "rid",
                            "return_hidden_states", "custom_logit_processor", "bootstrap_host", "priority"})
_UPDATE_KEYS = frozenset({"model_path", "load_format", "abort_all_requests", "weight_version", "is_async",
                          "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache",
                          "manifest"})


class _Reject(Exception):
    def __init__(self, status: int, body: dict):
        super().__init__(body)
        self.status, self.body = status, body


@torch.no_grad()
def _merged(base, adapter_dir: Path):
    """A copy of ``base`` with the PEFT adapter at ``adapter_dir`` merged in (tiny models: a copy is cheap)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), str(adapter_dir)).merge_and_unload().eval()


class FakeSGLang:
    """The raw ASGI app, holding a tiny model. See the module docstring for routes and knobs."""

    def __init__(self, model_dir: str | Path, *, weight_version: str = "default", original_logprob: bool = True,
                 enable_lora: bool = True, max_loaded_loras: int | None = None, served_model_name: str | None = None,
                 seed: int = 0, incremental_streaming_output: bool = False, deterministic_inference: bool = False,
                 seed_bits: int = 32, cwd: str | Path | None = None, dtype: str | None = None,
                 lora_target_modules: list[str] | None = None):
        from reef_core.models.loading import load_model

        self.model_dir = Path(model_dir)
        self.model, self.tok = load_model(self.model_dir)
        if dtype is not None:  # e.g. "bfloat16": serve at the precision a GPU server would
            self.model = self.model.to(getattr(torch, dtype))
        self.incremental_streaming_output = incremental_streaming_output
        self.deterministic_inference = deterministic_inference
        self.seed_bits = seed_bits
        self.cwd = Path(cwd) if cwd is not None else Path.cwd()
        self.lora_target_modules = lora_target_modules
        self.crashed: str | None = None  # why the scheduler died (every route fails from then on)
        self.served_model_name = served_model_name or self.model_dir.name
        self.weight_version = weight_version
        self.original_logprob = original_logprob
        self.enable_lora = enable_lora
        self.max_loaded_loras = max_loaded_loras
        self.eos = {int(self.tok.eos_token_id)} if self.tok.eos_token_id is not None else set()
        self._gen = torch.Generator().manual_seed(seed)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fake-sglang")
        self._lock = threading.Lock()
        self._adapters: OrderedDict[str, tuple[Path, Any]] = OrderedDict()  # loaded, LRU order
        self._known: dict[str, Path] = {}  # every adapter ever loaded and not unloaded (an evicted one reloads)
        self._faults: list[dict] = []
        self.token_delay_s = 0.0
        self.paused: str | None = None  # pause mode while paused
        self._resumed: asyncio.Event | None = None
        self._idle: asyncio.Condition | None = None
        self._aborting: set[str] = set()
        self.in_flight: dict[str, str] = {}  # rid -> weight version it started on
        self.stats: dict[str, Any] = {"generate": 0, "chat": 0, "updates": 0, "loads": 0, "unloads": 0,
                                      "evictions": 0, "aborted": 0}
        self.log: deque[dict] = deque(maxlen=200)

    # ---- knobs -------------------------------------------------------------------------------------------
    def add_fault(self, op: str, fail_next: int = 1, **spec) -> None:
        with self._lock:
            self._faults.append({"op": op, "left": int(fail_next), **spec})

    def _take_fault(self, op: str) -> dict | None:
        with self._lock:
            for f in self._faults:
                if f["op"] == op and f["left"] > 0:
                    f["left"] -= 1
                    if f["left"] == 0:
                        self._faults.remove(f)
                    return f
        return None

    def loaded_adapters(self) -> list[str]:
        return list(self._adapters)

    def snapshot(self) -> dict:
        return {"weight_version": self.weight_version, "paused": self.paused, "crashed": self.crashed,
                "in_flight": dict(self.in_flight),
                "loaded_adapters": self.loaded_adapters(), "known_adapters": sorted(self._known),
                "stats": dict(self.stats), "pending_faults": [dict(f) for f in self._faults]}

    # ---- ASGI --------------------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        raw = await read_request(scope, receive, send)
        if raw is None:
            return
        if self._resumed is None:  # asyncio primitives belong to the serving loop
            self._resumed = asyncio.Event()
            self._resumed.set()
            self._idle = asyncio.Condition()
        path, method = scope["path"], scope["method"]
        if self.crashed is not None and path != "/_fake/stats":
            await _json(send, 503 if path in ("/health", "/health_generate") else 500,
                        {"error": {"message": f"the scheduler died: {self.crashed}"}})
            return
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            await _json(send, 400, {"error": {"message": "invalid JSON body"}})
            return
        try:
            await self._route(path, method, body, send, query=scope.get("query_string", b""))
        except _Reject as r:
            await _json(send, r.status, r.body)

    async def _route(self, path: str, method: str, body: Any, send, query: bytes = b"") -> None:
        get = {"/health": self._health, "/health_generate": self._health, "/model_info": self._model_info,
               "/get_model_info": self._model_info, "/server_info": self._server_info, "/get_server_info": self._server_info,
               "/v1/models": self._models,
               "/_fake/stats": self.snapshot}
        post = {"/update_weights_from_disk": self._update_from_disk, "/update_weight_version": self._relabel,
                "/pause_generation": self._pause, "/continue_generation": self._continue,
                "/load_lora_adapter": self._load_lora, "/unload_lora_adapter": self._unload_lora,
                "/flush_cache": self._flush, "/abort_request": self._abort_request,
                "/_fake/faults": self._faults_route, "/_fake/settings": self._settings}
        if method == "GET" and path in get:
            await _json(send, 200, get[path]())
        elif method == "POST" and path == "/generate":
            await self._generate_route(body, send)
        elif method == "POST" and path == "/v1/chat/completions":
            await self._chat_route(body, send)
        elif method == "POST" and path in post:
            if not isinstance(body, dict):
                raise _Reject(422, {"detail": f"{path} needs a JSON object body"})
            result = post[path](body)
            if asyncio.iscoroutine(result):
                result = await result
            status, payload = result if isinstance(result, tuple) else (200, result)
            await _json(send, status, payload)
        else:
            await _json(send, 404, {"detail": "Not Found"})

    # ---- metadata ----------------------------------------------------------------------------------------
    def _health(self) -> dict:
        return {}

    def _model_info(self) -> dict:
        return {"model_path": str(self.model_dir), "tokenizer_path": str(self.model_dir), "is_generation": True,
                "weight_version": self.weight_version, "has_image_understanding": False,
                "has_audio_understanding": False}

    def _server_info(self) -> dict:
        return {"model_path": str(self.model_dir), "served_model_name": self.served_model_name,
                "enable_lora": self.enable_lora, "max_loaded_loras": self.max_loaded_loras,
                "weight_version": self.weight_version, "version": "fake-0.5",
                "incremental_streaming_output": self.incremental_streaming_output,
                "enable_deterministic_inference": self.deterministic_inference,
                "lora_target_modules": self.lora_target_modules, "random_seed": 0}

    def _models(self) -> dict:
        cards = [{"id": self.served_model_name, "object": "model", "owned_by": "sglang", "root": str(self.model_dir)}]
        cards += [{"id": name, "object": "model", "owned_by": "sglang", "root": str(path),
                   "parent": self.served_model_name} for name, (path, _m) in self._adapters.items()]
        return {"object": "list", "data": cards}

    def _faults_route(self, body: dict) -> dict:
        specs = body.get("faults", [body])
        for spec in specs:
            spec = dict(spec)
            self.add_fault(spec.pop("op"), spec.pop("fail_next", 1), **spec)
        return {"queued": len(specs)}

    def _settings(self, body: dict) -> dict:
        if "token_delay_s" in body:
            self.token_delay_s = float(body["token_delay_s"])
        return {"token_delay_s": self.token_delay_s}

    # ---- admission ---------------------------------------------------------------------------------------
    async def _pause(self, body: dict) -> dict:
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise _Reject(400, {"success": False, "message": f"unknown pause mode {mode!r}"})
        self.paused = mode
        self._resumed.clear()
        if mode == "abort":  # SGLang's tokenizer manager aborts until no request is left, then answers
            self._aborting.update(self.in_flight)
            await self._wait_idle()
        return {"success": True, "message": f"paused ({mode})"}

    def _continue(self, body: dict) -> dict:
        self.paused = None
        self._resumed.set()
        return {"success": True, "message": "continued"}

    def _flush(self, body: dict) -> tuple[int, dict]:
        if self.in_flight:
            return 400, {"success": False, "message": "cannot flush the cache while requests are running"}
        return 200, {"success": True, "message": "flushed"}

    def crash(self, reason: str) -> None:
        """The scheduler process died (SGLang then takes the whole server down)."""
        self.crashed = reason
        self._aborting.update(self.in_flight)
        if self._resumed is not None:  # paused and retracted requests end too: a dead server holds none
            self._resumed.set()

    def resolve(self, path: str) -> Path:
        """A path as the server reads it: relative ones against its own working directory."""
        return self.cwd / path

    def _abort_request(self, body: dict) -> dict:
        rid = body.get("rid")
        if body.get("abort_all"):
            self._aborting.update(self.in_flight)
        elif rid in self.in_flight:
            self._aborting.add(rid)
        return {"success": True}

    async def _wait_idle(self) -> None:
        async with self._idle:
            await self._idle.wait_for(lambda: not self.in_flight)

    async def _enter(self, rid: str) -> None:
        await self._resumed.wait()  # new requests wait while generation is paused
        self.in_flight[rid] = self.weight_version

    async def _leave(self, rid: str) -> None:
        self.in_flight.pop(rid, None)
        self._aborting.discard(rid)
        async with self._idle:
            self._idle.notify_all()

    # ---- weights -----------------------------------------------------------------------------------------
    async def _update_from_disk(self, body: dict) -> tuple[int, dict]:
        unknown = sorted(set(body) - _UPDATE_KEYS)
        if unknown or not isinstance(body.get("model_path"), str):
            return 422, {"detail": f"model_path (a string) is required; unknown fields {unknown}"}
        if body.get("abort_all_requests"):
            self._aborting.update(self.in_flight)
        if self.paused is None:
            await self._wait_idle()  # SGLang waits for in-flight requests unless generation is paused
        fault = self._take_fault("update_weights_from_disk")
        if fault is not None:
            return 400, {"success": False, "message": fault.get("message", "injected failure: weights not loaded"),
                         "num_paused_requests": 0}
        try:
            await asyncio.wrap_future(self._worker.submit(self._load_dir, self.resolve(body["model_path"])))
        except Exception as exc:  # noqa: BLE001 - the failure is the answer, the old weights stay
            return 400, {"success": False, "message": f"Failed to update weights: {exc}", "num_paused_requests": 0}
        if body.get("flush_cache", True) and self.in_flight:
            # SGLang asserts that the flush after an update succeeded; the flush refuses while the scheduler holds
            # any request (running, paused in place or retracted into the waiting queue): the scheduler dies.
            self.crash(f"Cache flush failed after updating weights ({len(self.in_flight)} requests held, "
                       f"pause mode {self.paused})")
            return 500, {"error": {"message": "Cache flush failed after updating weights"}}
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        self.stats["updates"] += 1
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def _load_dir(self, path: Path) -> None:
        """Worker thread: every tensor of the directory's safetensors files, checked before any is copied."""
        from safetensors.torch import load_file

        files = sorted(path.glob("*.safetensors"))
        if not path.is_dir() or not files:
            raise FileNotFoundError(f"no safetensors weights in {path}")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        own = self.model.state_dict()
        bad = sorted(k for k, v in state.items() if k not in own or tuple(v.shape) != tuple(own[k].shape))
        if bad:
            raise ValueError(f"tensors that do not fit the model: {bad[:3]}")
        with torch.no_grad():
            for k, v in state.items():
                own[k].copy_(v.to(own[k].dtype))
        for name, (adapter_dir, _m) in list(self._adapters.items()):  # adapters sit on the new base
            self._adapters[name] = (adapter_dir, _merged(self.model, adapter_dir))

    def _relabel(self, body: dict) -> dict:
        if not isinstance(body.get("new_version"), str):
            raise _Reject(422, {"detail": "new_version (a string) is required"})
        if body.get("abort_all_requests", True):
            self._aborting.update(self.in_flight)
        self.weight_version = body["new_version"]
        return {"success": True, "message": "version updated"}

    async def _load_lora(self, body: dict) -> tuple[int, dict]:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not self.enable_lora:
            return 400, {"success": False, "error_message": "LoRA is not enabled: start with --enable-lora",
                         "loaded_adapters": {}}
        if not isinstance(name, str) or not isinstance(path, str):
            return 422, {"detail": "lora_name and lora_path (strings) are required"}
        if name in self._known:
            return 400, {"success": False, "error_message": f"LoRA adapter {name!r} is already loaded",
                         "loaded_adapters": self._loaded_map()}
        fault = self._take_fault("load_lora_adapter")
        if fault is not None:
            return 400, {"success": False, "error_message": "injected failure", "loaded_adapters": self._loaded_map()}
        try:
            await self._materialise(name, self.resolve(path))
        except Exception as exc:  # noqa: BLE001
            return 400, {"success": False, "error_message": f"failed to load adapter: {exc}",
                         "loaded_adapters": self._loaded_map()}
        self._known[name] = self.resolve(path)
        self.stats["loads"] += 1
        return 200, {"success": True, "error_message": None, "loaded_adapters": self._loaded_map()}

    async def _materialise(self, name: str, path: Path) -> None:
        merged = await asyncio.wrap_future(self._worker.submit(_merged, self.model, path))
        self._adapters[name] = (path, merged)
        self._adapters.move_to_end(name)
        while self.max_loaded_loras and len(self._adapters) > self.max_loaded_loras:
            self._adapters.popitem(last=False)  # LRU eviction: still known, reloaded on use
            self.stats["evictions"] += 1

    def _unload_lora(self, body: dict) -> tuple[int, dict]:
        name = body.get("lora_name")
        if name not in self._known:
            return 400, {"success": False, "error_message": f"LoRA adapter {name!r} is not loaded",
                         "loaded_adapters": self._loaded_map()}
        self._known.pop(name)
        self._adapters.pop(name, None)
        self.stats["unloads"] += 1
        return 200, {"success": True, "error_message": None, "loaded_adapters": self._loaded_map()}

    def _loaded_map(self) -> dict:
        return {name: str(path) for name, (path, _m) in self._adapters.items()}

    async def _model_for(self, lora: str | None):
        if lora is None:
            return self.model
        if lora not in self._known:
            raise _Reject(400, {"error": {"message": f"LoRA adapter {lora!r} was never loaded"}})
        if lora not in self._adapters:
            await self._materialise(lora, self._known[lora])  # evicted: SGLang reloads it implicitly
        self._adapters.move_to_end(lora)
        return self._adapters[lora][1]

    # ---- generation --------------------------------------------------------------------------------------
    def _params(self, sp: Any) -> dict:
        if sp is None:
            sp = {}
        if not isinstance(sp, dict):
            raise _Reject(400, {"error": {"message": "sampling_params must be an object"}})
        unknown = sorted(set(sp) - SAMPLING_KEYS)
        if unknown:  # SGLang fails inside SamplingParams(**sp): a 500, not a 400
            raise _Reject(500, {"error": {"message": f"SamplingParams got unexpected keyword arguments {unknown}"}})
        stop = sp.get("stop") or []
        seed = sp.get("sampling_seed")
        if not self.deterministic_inference:
            seed = None  # SGLang reads sampling_seed only with --enable-deterministic-inference
        else:
            seed = 42 if seed is None else int(seed)  # SGLang's default seed for requests without one
            bound = 2 ** (self.seed_bits - 1)
            if not -bound <= seed < bound:  # the seed tensor's constructor overflows inside the scheduler
                self.crash(f"sampling_seed {seed} does not fit int{self.seed_bits}")
                raise _Reject(500, {"error": {"message": f"value cannot be converted to int{self.seed_bits}"}})
        return {"max_new": int(sp.get("max_new_tokens", 128)), "temperature": float(sp.get("temperature", 1.0)),
                "top_p": float(sp.get("top_p", 1.0)), "top_k": int(sp.get("top_k", -1)),
                "min_p": float(sp.get("min_p", 0.0)), "stops": [stop] if isinstance(stop, str) else list(stop),
                "stop_ids": set(sp.get("stop_token_ids") or []), "ignore_eos": bool(sp.get("ignore_eos", False)),
                "seed": seed}

    def _step(self, model, ids: list[int], p: dict, gen: torch.Generator, top_n: int):
        """Worker thread: one forward over the whole sequence; (token, its log-prob, top list)."""
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        greedy = p["temperature"] < 1e-5
        t = 1.0 if greedy else p["temperature"]
        logp = torch.log_softmax(logits if self.original_logprob else logits / t, dim=-1)
        if greedy:
            tid = int(torch.argmax(logits))
        else:
            probs = torch.softmax(logits / t, dim=-1)
            if p["top_k"] > 0:
                kth = torch.topk(probs, min(p["top_k"], probs.numel())).values[-1]
                probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
            if p["min_p"] > 0:
                probs = torch.where(probs >= p["min_p"] * probs.max(), probs, torch.zeros_like(probs))
            if p["top_p"] < 1.0:
                sp, order = torch.sort(probs, descending=True)
                cum = torch.cumsum(sp, -1) / sp.sum()
                keep = (cum - sp / sp.sum()) < p["top_p"]
                keep[0] = True
                probs = torch.zeros_like(probs).scatter(0, order, sp * keep)
            tid = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
        top = None
        if top_n:
            vals, idx = torch.topk(logp, min(top_n, logp.numel()))
            top = [[float(v), int(i), None] for v, i in zip(vals, idx)]
        return tid, float(logp[tid]), top

    def _steps(self, model, ids: list[int], p: dict, gen: torch.Generator, top_n: int, state: dict, rid: str,
               limit: int) -> None:
        """Worker thread: up to ``limit`` steps into ``state``, stopping early at a stop condition or when the
        request is paused or aborted (checked between steps, like SGLang's scheduler)."""
        for _ in range(limit):
            if len(state["output_ids"]) >= p["max_new"] or state["finish"] is not None:
                return
            if self.paused is not None or rid in self._aborting:
                return
            tid, lp, top = self._step(model, ids, p, gen, top_n)
            ids.append(tid)
            state["output_ids"].append(tid)
            state["logprobs"].append(lp)
            state["top"].append(top)
            text = self.tok.decode(state["output_ids"], skip_special_tokens=True)
            if tid in p["stop_ids"] or (tid in self.eos and not p["ignore_eos"]):
                state["finish"] = {"type": "stop", "matched": tid}
                state["text"] = self.tok.decode(state["output_ids"][:-1], skip_special_tokens=True)
                return
            cut = min((i for i in (text.find(s) for s in p["stops"] if s) if i >= 0), default=-1)
            if cut >= 0:
                state["finish"] = {"type": "stop", "matched": next(s for s in p["stops"] if s and text.find(s) == cut)}
                state["text"] = text[:cut]
                return
            state["text"] = text

    async def _run(self, prompt_ids: list[int], p: dict, lora: str | None, top_n: int, rid: str, stream: bool):
        """Async generator of cumulative states: dicts with ``output_ids``, ``logprobs``, ``top``, ``finish``.
        Streams (and slowed runs) advance one token per worker call; others as far as they can in one."""
        model = await self._model_for(lora)
        gen = torch.Generator().manual_seed(int(p["seed"])) if p["seed"] is not None else self._gen
        fault = self._take_fault("generate")
        if fault and not fault.get("abort"):
            raise _Reject(int(fault.get("status", 500)), {"error": {"message": "injected generate failure"}})
        state = {"output_ids": [], "logprobs": [], "top": [], "finish": None, "text": ""}
        ids = list(prompt_ids)
        while state["finish"] is None and len(state["output_ids"]) < p["max_new"]:
            if self.paused is not None and rid not in self._aborting:
                await self._resumed.wait()  # retract / in_place: resume after continue
                model = await self._model_for(lora)  # weights may have changed meanwhile
            aborted = fault and fault.get("abort") and len(state["output_ids"]) >= fault.get("after_tokens", 0)
            if rid in self._aborting or aborted:
                self.stats["aborted"] += 1
                state["finish"] = {"type": "abort", "message": "Abort before update weights"
                                   if rid in self._aborting else "injected abort"}
                break
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            one = stream or self.token_delay_s or (fault and fault.get("abort"))
            await asyncio.wrap_future(self._worker.submit(self._steps, model, ids, p, gen, top_n, state, rid,
                                                          1 if one else p["max_new"]))
            if stream and state["finish"] is None and len(state["output_ids"]) < p["max_new"]:
                yield state
        if state["finish"] is None:
            state["finish"] = {"type": "length", "length": len(state["output_ids"])}
        yield state

    def _prompt_logprobs(self, model, prompt_ids: list[int], start: int) -> list:
        """Worker thread: ``input_token_logprobs`` from ``start`` (the first prompt token has none)."""
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt_ids])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        return [[None if i == 0 else float(logp[i - 1, tid]), tid, None]
                for i, tid in enumerate(prompt_ids) if i >= start]

    def _native_body(self, state: dict, prompt_ids: list[int], rid: str, version: str, logprob: bool,
                     top_n: int, started: float, input_lps: list | None = None, offset: int = 0) -> dict:
        meta = {"id": rid, "finish_reason": state["finish"], "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(state["output_ids"]), "cached_tokens": 0, "weight_version": version,
                "e2e_latency": time.monotonic() - started}
        if logprob:
            meta["input_token_logprobs"] = list(input_lps or [])
            meta["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(state["logprobs"][offset:],
                                                                                 state["output_ids"][offset:])]
            if top_n:
                meta["input_top_logprobs"] = []
                meta["output_top_logprobs"] = list(state["top"][offset:])
        # offset > 0: an incremental stream chunk carries only what is new since the last one
        return {"text": state["text"], "output_ids": list(state["output_ids"][offset:]), "meta_info": meta}

    async def _generate_route(self, body: Any, send) -> None:
        if not isinstance(body, dict):
            raise _Reject(422, {"detail": "a JSON object body is required"})
        unknown = sorted(set(body) - _GENERATE_KEYS)
        if unknown:
            raise _Reject(422, {"detail": f"unknown fields {unknown}"})
        if body.get("input_ids") is not None:
            prompt = body["input_ids"]
            if not (isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt)):
                raise _Reject(400, {"error": {"message": "input_ids must be a non-empty list of token ids"}})
            if any(not 0 <= i < len(self.tok) for i in prompt):
                raise _Reject(400, {"error": {"message": "input_ids hold an id outside the vocabulary"}})
        elif isinstance(body.get("text"), str):
            prompt = list(self.tok(body["text"], add_special_tokens=False)["input_ids"])
        else:
            raise _Reject(400, {"error": {"message": "either text or input_ids must be given"}})
        p = self._params(body.get("sampling_params"))
        top_n = int(body.get("top_logprobs_num") or 0)
        logprob = bool(body.get("return_logprob"))
        lora = body.get("lora_path")
        if lora is not None and not self.enable_lora:
            raise _Reject(400, {"error": {"message": "lora_path given but LoRA is not enabled"}})
        rid = str(body.get("rid") or uuid.uuid4().hex)
        self.stats["generate"] += 1
        self.log.append({"route": "generate", "body": body})
        started = time.monotonic()
        start = body.get("logprob_start_len")
        await self._enter(rid)
        version = self.weight_version
        try:
            input_lps = None
            if logprob and isinstance(start, int) and start >= 0:
                model = await self._model_for(lora)
                input_lps = await asyncio.wrap_future(self._worker.submit(self._prompt_logprobs, model, prompt,
                                                                          start))
            runs = self._run(prompt, p, lora, top_n, rid, bool(body.get("stream")))
            if not body.get("stream"):
                state = None
                async for state in runs:
                    pass
                await _json(send, 200, self._native_body(state, prompt, rid, version, logprob, top_n, started,
                                                         input_lps))
                return
            await _sse_start(send)
            sent_ids, sent_text = 0, ""
            try:
                async for state in runs:
                    chunk = self._native_body(state, prompt, rid, version, logprob, top_n, started, input_lps,
                                              sent_ids if self.incremental_streaming_output else 0)
                    if self.incremental_streaming_output:
                        chunk["text"] = state["text"][len(sent_text):]
                        sent_ids, sent_text = len(state["output_ids"]), state["text"]
                    if state["finish"] is None:
                        chunk["meta_info"]["finish_reason"] = None
                    await _sse(send, json.dumps(chunk))
            except _Reject as r:
                await _sse(send, json.dumps({"error": r.body.get("error", r.body)}))
            await _sse(send, "[DONE]")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self._leave(rid)

    # ---- OpenAI-compatible route ---------------------------------------------------------------------------
    async def _chat_route(self, body: Any, send) -> None:
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            raise _Reject(400, {"object": "error", "message": "messages must be a non-empty list", "code": 400})
        model = str(body.get("model") or self.served_model_name)
        lora = model.split(":", 1)[1] if ":" in model else body.get("lora_path")
        messages = [{"role": m.get("role"), "content": m.get("content") if isinstance(m.get("content"), str)
                     else "".join(part.get("text", "") for part in m.get("content") or [] if isinstance(part, dict))}
                    for m in body["messages"]]
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = list(self.tok(text, add_special_tokens=False)["input_ids"])
        sp = {"max_new_tokens": body.get("max_completion_tokens") or body.get("max_tokens") or 128,
              "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
              "stop": body.get("stop") or [], "sampling_seed": body.get("seed")}
        p = self._params(sp)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        self.stats["chat"] += 1
        self.log.append({"route": "chat", "body": body})
        await self._enter(rid)
        try:
            runs = self._run(prompt, p, lora, 0, rid, bool(body.get("stream")))
            created = int(time.time())
            base = {"id": rid, "created": created, "model": model}
            if not body.get("stream"):
                state = None
                async for state in runs:
                    pass
                await _json(send, 200, {**base, "object": "chat.completion", "choices": [{
                    "index": 0, "message": {"role": "assistant", "content": state["text"]},
                    "logprobs": None, "finish_reason": _openai_finish(state["finish"])}],
                    "usage": _usage(prompt, state)})
                return
            await _sse_start(send)
            sent = ""
            await _sse(send, json.dumps({**base, "object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}))
            state = None
            async for state in runs:
                piece, sent = state["text"][len(sent):], state["text"]
                if piece:
                    await _sse(send, json.dumps({**base, "object": "chat.completion.chunk", "choices": [
                        {"index": 0, "delta": {"content": piece}, "finish_reason": None}]}))
            await _sse(send, json.dumps({**base, "object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {}, "finish_reason": _openai_finish(state["finish"])}]}))
            await _sse(send, "[DONE]")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self._leave(rid)


def _openai_finish(finish: dict) -> str:
    return {"length": "length", "abort": "abort"}.get(finish["type"], "stop")


def _usage(prompt: list[int], state: dict) -> dict:
    n = len(state["output_ids"])
    return {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}


async def _json(send, status: int, obj: Any) -> None:
    data = json.dumps(obj).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


async def _sse_start(send) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})


async def _sse(send, data: str) -> None:
    await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})


# ---- running it -------------------------------------------------------------------------------------------

@contextlib.contextmanager
def serve_fake_sglang(model_dir: str | Path | None = None, *, mode: str = "thread", app: FakeSGLang | None = None,
                      **options) -> Iterator[str]:
    """Serve a FakeSGLang on a free loopback port and yield its base URL.

    ``mode="thread"`` serves ``app`` (or a new one over ``model_dir``) in this process, so a test can reach its
    knobs directly; ``mode="process"`` runs ``python -m reef_core.testing.fake_sglang`` (faults through the control
    routes), as a managed engine would be."""
    if mode == "thread":
        with serve_asgi(app or FakeSGLang(model_dir, **options)) as url:
            yield url
        return
    if mode != "process":
        raise ValueError("mode must be 'thread' or 'process'")
    cmd = [sys.executable, "-m", "reef_core.testing.fake_sglang", "--model-dir", str(model_dir), "--port", "0"]
    for key, value in options.items():  # the CLI flags of main(), e.g. token_delay_s=0.02 -> --token-delay-s 0.02
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    with fake_in_process(cmd, "FAKE_SGLANG", "fake SGLang") as url:
        yield url


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="FakeSGLang: a fake SGLang server over a tiny model (tests only)")
    parser.add_argument("--model-dir", "--model-path", dest="model_dir", required=True)
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--max-loaded-loras", type=int, default=None)
    parser.add_argument("--no-original-logprob", action="store_true",
                        help="log-probs at the request's temperature (SGLang without SGLANG_RETURN_ORIGINAL_LOGPROB)")
    parser.add_argument("--disable-lora", action="store_true")
    parser.add_argument("--token-delay-s", type=float, default=0.0, help="wait this long before each token")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (a tiny model)")
    parser.add_argument("--incremental-streaming-output", action="store_true")
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    args, _rest = parser.parse_known_args(argv)  # a launcher may pass SGLang flags the fake ignores
    torch.set_num_threads(args.torch_threads)
    app = FakeSGLang(args.model_dir, weight_version=args.weight_version, max_loaded_loras=args.max_loaded_loras,
                     original_logprob=not args.no_original_logprob, enable_lora=not args.disable_lora,
                     incremental_streaming_output=args.incremental_streaming_output,
                     deterministic_inference=args.enable_deterministic_inference)
    app.token_delay_s = args.token_delay_s
    sock = bound_socket(args.host, args.port)
    print(f"FAKE_SGLANG http://{args.host}:{sock.getsockname()[1]}", flush=True)
    uvicorn_server(app).run(sockets=[sock])


if __name__ == "__main__":
    main()
