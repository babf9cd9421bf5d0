"""LocalEngine: serve a transformers causal LM in-process, speaking OpenAI Chat Completions.

All torch work (loading, tokenizing, generating, swapping weights) runs on ONE dedicated worker
thread (:mod:`reef_core.engines.local_worker`), in submission order, so the event loop never blocks and torch is
never entered twice at once. Concurrent requests are decoded as one batch (continuous batching, up to
``max_batch_size`` rows, ``engine.max_batch_size``): a request arriving while others decode is prefilled and joins
them at the next step, and each step runs one forward for every row (weights read once per step, not once per
request), each row over its own KV cache at its own position, with its own sampling parameters, generator, stop
conditions and budget. A stream hands each piece of text to the loop as soon as it is generated.

Sampling is a manual loop over the KV cache: the request's ``temperature``, ``top_p``,
``max_tokens``/``max_completion_tokens``, ``stop`` and ``seed`` override the engine defaults
(temperature 0 = greedy). For every sampled token the engine records its log-probability under the
model's *raw* distribution at temperature 1, ``log_softmax(logits)[token]`` -- not the temperature- or
top-p-modified sampling distribution -- which is what importance-weighted objectives (SAO) compare a
trained policy against. With ``top_k_logprobs`` = K > 0 it also keeps, per token, the K most likely ids under that
same distribution and their log-probs (``TokenData.top_k``), taken from the log-softmax it already computed: one
``topk`` per step on the device, one copy to the host per generation, no extra forward pass.

Decode path: for Llama-family models (Llama, Qwen2) in float32 each forward pass is computed by
:class:`reef_core.engines.decode.FastDecoder` -- a static KV cache, the prompt (the prompts of the requests that
join a batch at one step, together) and each decode step through every layer in calls of a small C kernel
(:mod:`reef_core.engines.kernels`) over packed copies of the weights (bf16 where they are exactly bf16: a bf16
checkpoint, a LoRA base; products on AMX tiles where the CPU has them) -- instead of transformers' module stack:
same float32 arithmetic, ~2-4x less memory traffic and almost no Python work per token. Other models, or a failed
warm-up, keep transformers' forward (:attr:`LocalEngine.decode_path` says which served the last generation). The
engine warms the path up at load, so the first request pays no one-time cost.

Loading: a Llama checkpoint stored in bf16 (SmolLM2) is read by :mod:`reef_core.engines.lean_model`, without
transformers' modeling code (seconds of imports at start-up); the transformers model replaces it the first time its
forward or peft is needed. Anything else loads through :func:`reef_core.models.loading.load_model`. The decode kernel's
packed weights are mapped in from :mod:`reef_core.engines.packcache` when an earlier start wrote them.
:meth:`LocalEngine.preload` begins all this on the worker before :meth:`LocalEngine.start` waits for it.

Stop handling: generation ends at an end-of-sequence token (kept in ``TokenData.output_ids``, not in the
text), at a stop string (the text is cut before it; the token that completed it stays in ``output_ids``),
or at the token budget (``finish_reason="length"``).

Versioned weights: ``version`` (default ``"base"``) names the weights being served; :meth:`swap_weights`
is queued on the worker like a request, so it happens between requests: the batch closes to newcomers, the rows in
flight finish on version v, the swap runs, then requests queued after it start on the new version; every response's
``TokenData.version`` names the weights that produced it. Rows share a batch only when served by the same adapter
(else the next adapter's requests wait for the batch to drain); transformers' forward serves one row at a time.

Adapters: :meth:`load_adapter` adds (or replaces) a named LoRA adapter kept *unmerged* beside the base weights
(``peft``: the model is wrapped once, each adapter gets its own slot), :meth:`drop_adapter` removes one. A request
is served by the adapter whose version it was frozen on (``EngineRequest.version`` -- each adapter's versions are
remembered under its name, so a request frozen just before a replacement is served by the replacement and says
so); a version no adapter ever served runs the base with every adapter disabled. The adapter is switched on the
worker thread, right before the request's generation, so log-probs and top-K come from that adapter's
distribution. While any adapter exists a full-weight :meth:`swap_weights` is refused: it would move the base
every adapter sits on.

Tool calls: a request's tools are rendered through the model's chat template, and the calls the model writes are
parsed by ``engine.tool_call_parser`` (:mod:`reef_core.engines.toolcalls`) into ``message.tool_calls`` (finish reason
``tool_calls``); a stream relays text as it is generated and each call as one ``delta.tool_calls`` chunk once its
block closes.

Streams: ``chat.completion.chunk`` events (role chunk, content chunks, finish chunk, an optional usage
chunk), then ``StreamEvent(TOKENS_EVENT, TokenData.to_event())``, then ``"[DONE]"``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import torch

from reef_core.config.schema import EngineConfig
from reef_core.models.adapter import AdapterWeights
from reef_core.wire import TOKEN_COUNT_HEADER
from reef_core.engines.base import (
    TOKENS_EVENT,
    Engine,
    EngineRequest,
    EngineResponse,
    StreamEvent,
    TokenData,
)
from reef_core.engines.chat_body import SamplingParams, chat_messages, sampling_params
from reef_core.engines import kernels, lean_model, packcache
from reef_core.engines.decode import FastDecoder, Packed, prefill_rows, step_rows, supports
from reef_core.engines.toolcalls import ToolCallStream, finish_reason, request_tools, resolve_parser, tool_parser
from reef_core.engines.local_worker import Worker
from reef_core.topk import MAX_K, TopK
from reef_core.engines.translate import anthropic_count_tokens_to_openai
from reef_core.errors import ConfigError, Conflict, ReefError, UpstreamError, ValidationFailed
from reef_core.models.device import resolve_device


log = logging.getLogger(__name__)

_UNKNOWN = object()  # which adapter the model applies is not known (a slot was just added or removed)


def _load_model(model_dir: Path):
    """(model, tokenizer) from a local directory: a bf16 Llama checkpoint through the lean loader (no transformers
    modeling code: :mod:`reef_core.engines.lean_model`), anything else through Reef's model factory."""
    model = lean_model.load(model_dir)
    if model is not None:
        return model, lean_model.load_tokenizer(model_dir)
    from reef_core.models.loading import load_model

    return load_model(model_dir)


# ---------------------------------------------------------------------------------------------------------
# request parameters


def _chat_messages(body: dict) -> list[dict]:
    return chat_messages(body, where="the local engine's message content")


# ---------------------------------------------------------------------------------------------------------
# incremental detokenization with stop strings


class _TextStream:
    """Turns sampled token ids into text pieces, identically for streamed and non-streamed requests.

    Decodes a sliding window (prefix/read offsets) so each step costs O(window), holds back an incomplete
    UTF-8 sequence (decoded as U+FFFD) and any suffix that could be the start of a stop string.
    """

    def __init__(self, tokenizer, stops: list[str]):
        self.tok = tokenizer
        self.stops = [s for s in stops if s]
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self.full = ""  # text decoded so far (cut at a stop string once one is seen)
        self.sent = 0  # characters of `full` already released
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def _advance(self, force: bool) -> None:
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and (force or not after.endswith("\ufffd")):
            self.full += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the text that can be released now."""
        self.ids.append(token_id)
        self._advance(force=False)
        return self._release(final=False)

    def finish(self) -> str:
        """Flush everything still held back."""
        if not self.stopped:
            self._advance(force=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        limit = len(self.full)
        if self.stops:
            cut = min((i for i in (self.full.find(s, self.sent) for s in self.stops) if i >= 0), default=-1)
            if cut >= 0:
                self.full = self.full[:cut]
                self.stopped = True
                limit = cut
            elif not final:
                hold = 0
                for s in self.stops:
                    for k in range(min(len(s) - 1, len(self.full) - self.sent), hold, -1):
                        if self.full.endswith(s[:k]):
                            hold = k
                            break
                limit -= hold
        out = self.full[self.sent:limit]
        self.sent = limit
        return out


@dataclass
class _Adapter:
    """What requests naming an adapter get: ``slot`` (its peft adapter name; None: the base) under ``version``."""

    version: str
    slot: str | None
    config: dict | None


@dataclass
class _Result:
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    version: str = "base"
    lp_entries: list[dict] = field(default_factory=list)  # OpenAI logprobs.content entries
    top_k: TopK | None = None

    def tokens(self) -> TokenData:
        return TokenData(self.prompt_ids, self.output_ids, self.logprobs, self.version, self.top_k)


@dataclass
class _Job:
    """One queued generation: the request, and where its events and its outcome go (called on the worker)."""

    messages: list[dict]
    tools: list | None
    params: SamplingParams
    cancel: threading.Event
    done: Callable[[Any], None]  # the _Result, or the exception that ended it
    emit: Callable[[str, list[dict]], None] | None = None
    started: Callable[[str], None] | None = None
    frozen: str | None = None


@dataclass
class _Row:
    """A generation in flight: its state between decode steps."""

    job: _Job
    res: _Result
    text: _TextStream
    gen: torch.Generator
    max_new: int
    k: int  # top-K captured per token (0: off)
    dec: FastDecoder | None  # None: transformers' forward (``out`` holds its cache)
    logits: torch.Tensor | None = None  # the next token's, float32 [vocab]
    out: Any = None
    pending: list[dict] = field(default_factory=list)  # logprob entries not yet attached to emitted text
    top_vals: list[torch.Tensor] = field(default_factory=list)  # per step, on the device until the end
    top_ids: list[torch.Tensor] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------


class LocalEngine(Engine):
    """Serve a local causal LM (a directory loadable by ``reef_core.models.loading.load_model``).

    Args:
        model_dir: the model directory (config, weights, tokenizer with a chat template).
        max_new_tokens, temperature, top_p: defaults when the request does not set them.
        seed: seeds the engine's sampler once (reproducible runs); a request's ``seed`` takes precedence.
        device: ``engine.device``: ``auto``, ``cpu``, ``cuda``, ``cuda:N`` or ``mps`` (see
            :mod:`reef_core.models.device`); the model, the generation tensors and swapped weights live there.
        name: the model id it answers to (default: the directory name).
        version: the name of the initial weights.
        num_threads: ``engine.num_threads``: when set, ``torch.set_num_threads`` at load (process-wide, so the
            in-process trainer follows it) and the C decode kernel's thread count; 1 suits busy CPUs, where
            intra-op threads mostly wait on each other. None: torch's default (the machine's cores).
        top_k_logprobs: ``engine.top_k_logprobs``: K > 0 captures the top-K ids and log-probs of every output
            token in ``TokenData.top_k`` (0: off).
        tool_call_parser: ``engine.tool_call_parser``: how tool calls are read from the generated text
            (:mod:`reef_core.engines.toolcalls`; ``auto`` follows the model's chat template).
        max_batch_size: ``engine.max_batch_size``: the most requests decoded together (1: one at a time).
    """

    dialects = ("openai",)

    def __init__(
        self,
        model_dir: Path,
        *,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        device: str = EngineConfig.device,
        name: str | None = None,
        version: str = "base",
        num_threads: int | None = None,
        top_k_logprobs: int = EngineConfig.top_k_logprobs,
        tool_call_parser: str = EngineConfig.tool_call_parser,
        max_batch_size: int = EngineConfig.max_batch_size,
    ):
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or not 1 <= max_batch_size <= 256:
            raise ConfigError(f"engine.max_batch_size must be an integer from 1 to 256, got {max_batch_size!r}")
        self.max_batch_size = max_batch_size
        if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                        or not 1 <= num_threads <= 256):
            raise ConfigError(f"engine.num_threads must be an integer from 1 to 256 (or unset), got {num_threads!r}")
        if isinstance(top_k_logprobs, bool) or not isinstance(top_k_logprobs, int) or not 0 <= top_k_logprobs <= MAX_K:
            raise ConfigError(f"engine.top_k_logprobs must be an integer from 0 to {MAX_K}, got {top_k_logprobs!r}")
        self.top_k_logprobs = top_k_logprobs
        self.tool_call_parser = tool_parser(tool_call_parser)
        #: The parser in use once loaded (None: tool calls are not parsed).
        self.tool_parser: str | None = None
        self.model_dir = Path(model_dir)
        self.name = name or self.model_dir.name
        self.max_new_tokens = int(max_new_tokens)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.seed = seed
        self.device = torch.device(resolve_device(device, field="engine.device"))
        self.version = version
        self.num_threads = num_threads
        self._worker: Worker | None = None
        self._loading: concurrent.futures.Future | None = None  # the load :meth:`preload` queued, until started
        self._model = None
        self._tok = None
        self._gen: torch.Generator | None = None
        self._eos: set[int] = set()
        self._max_len: int | None = None
        self._max_token_chars = 1
        self._active: set[threading.Event] = set()
        self._peft = None  # the PeftModel around the model once an adapter is loaded (worker thread only)
        self._adapters: dict[str, _Adapter] = {}
        self._adapter_of: dict[str, str] = {}  # every version an adapter served under -> its name
        self._slots = 0  # peft adapter names are slot ids, never the (arbitrary) adapter names
        self._serving_slot: str | None | object = _UNKNOWN  # the adapter enabled now (None: all disabled)
        self._lean_slots: dict[str | None, bool] = {}  # adapter slot -> whether the lean pass serves it
        #: Counters updated by the worker: generations run, tokens sampled, generations cut short by a
        #: consumer that went away, decode forwards run, and the most rows one of them served.
        self.stats = {"generations": 0, "output_tokens": 0, "cancelled": 0, "decode_steps": 0, "max_rows": 0}
        #: Decode with :class:`reef_core.engines.decode.FastDecoder` when the model allows (False: transformers'
        #: forward, kept as the reference the fast pass is tested against).
        self.fast_decode = True
        self._fast_unsupported: str | None = "not loaded"
        self._packed: Packed | None = None
        #: Which forward served the last generation: "lean" (FastDecoder) or "transformers".
        self.decode_path: str | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def preload(self) -> None:
        """Start loading the model on the worker thread now; :meth:`start` waits for that load (``reef serve`` calls
        this as soon as the engine exists, so the load runs beside the record store's opening and the app's set-up)."""
        if self._worker is None:
            self._worker = Worker(self)
            self._loading = self._worker.call(self._load)

    async def start(self) -> None:
        self.preload()
        loading, self._loading = self._loading, None
        if loading is None:  # started already
            return
        try:
            await asyncio.wrap_future(loading)
        except BaseException:
            worker, self._worker = self._worker, None
            if worker is not None:
                await asyncio.to_thread(worker.stop)
            raise

    def _load(self) -> None:
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        model, tok = _load_model(self.model_dir)
        model.to(self.device)
        model.eval()
        self._model, self._tok = model, tok
        self.tool_parser = resolve_parser(self.tool_call_parser, tok.chat_template)
        eos: set[int] = set()
        for source in (getattr(model.generation_config, "eos_token_id", None), tok.eos_token_id):
            if isinstance(source, int):
                eos.add(source)
            elif isinstance(source, (list, tuple)):
                eos.update(int(x) for x in source)
        self._eos = eos
        self._max_len = getattr(model.config, "max_position_embeddings", None)
        # The most characters one token can stand for: a prompt longer than context x this cannot fit.
        self._max_token_chars = max((len(t) for t in tok.get_vocab()), default=1) or 1
        if not isinstance(model, lean_model.LeanLlama):
            self._forward_kw(model)
        self._fast_unsupported = supports(model)
        self._packed = Packed(kernels.kernel() if self.device.type == "cpu" else None)
        if self._packed.fn is not None:
            kernels.set_threads(torch.get_num_threads())  # the C kernel follows torch's thread count
        lean = not self._fast_unsupported and self._packed.fn is not None
        cached = lean and packcache.load(self.model_dir, model, self._packed)
        self._warm_up()
        if lean and not cached and not self._fast_unsupported:
            packcache.save(self.model_dir, model, self._packed)  # what the warm-up packed, for the next start
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(self.seed if self.seed is not None else secrets.randbits(63))

    def _forward_kw(self, model) -> None:
        """The keyword arguments transformers' forward of ``model`` takes for its KV cache and the prompt's logits."""
        # transformers 5 renamed the KV-cache argument/output `past_key_values` -> `cache`.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._prefill_kw = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def _transformers(self):
        """Worker thread: the served model as a transformers model, for transformers' forward and peft. A model the
        lean loader built is replaced the first time (loaded through transformers, its current weights copied over,
        their packed copies kept); requests before and after see the same weights."""
        model = self._model
        if not isinstance(model, lean_model.LeanLlama):
            return model
        from reef_core.models.loading import load_model

        full, _ = load_model(self.model_dir)
        full.load_state_dict(model.state_dict())
        full.to(self.device)
        full.eval()
        ours = dict(model.named_parameters())
        mats = {id(w): mat for w, mat in self._packed.items()} if self._packed is not None else {}
        if self._packed is not None:
            self._packed.clear()
            for name, w in full.named_parameters():
                if name in ours and id(ours[name]) in mats:
                    self._packed.put(w, mats[id(ours[name])])  # equal values: the copy stays valid
        self._forward_kw(full)
        self._model = full
        self._lean_slots.clear()
        log.info("local engine: transformers' model loaded (for its forward or an adapter)")
        return full

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Worker thread, at load: run a 3-token generation so the first request pays no one-time cost (bf16 weight
        copies, kernel and allocator warm-up). A failing fast path is switched off here, with the reason kept."""
        if self._fast_unsupported:
            log.info("local engine: transformers' forward (%s)", self._fast_unsupported)
            return
        try:
            dec = FastDecoder(self._model, None, 3, self.device, self._packed)
            dec.prefill([0, 0])
            dec.step(torch.zeros(1, dtype=torch.long, device=self.device))
        except Exception as exc:  # an architecture variant this pass gets wrong must not take the engine down
            self._fast_unsupported = f"warm-up failed: {exc.__class__.__name__}: {exc}"
            log.warning("local engine: fast decoding off, %s", self._fast_unsupported)

    async def close(self) -> None:
        worker, self._worker = self._worker, None
        self._loading = None
        if worker is None:
            return
        for ev in list(self._active):
            ev.set()  # stop generations in flight at their next token
        await asyncio.to_thread(worker.stop)
        self._model = self._tok = self._peft = None
        self._adapters.clear()
        self._adapter_of.clear()

    def model_ids(self) -> list[str]:
        return [self.name]

    async def _run(self, fn: Callable, *args):
        if self._worker is None:
            raise UpstreamError(f"engine {self.name} is not started")
        return await asyncio.wrap_future(self._worker.call(fn, *args))

    # ---- weights -----------------------------------------------------------------------------------------
    async def swap_weights(self, version: str, state_dict: dict | None = None) -> None:
        """Serve ``version`` from the next request on, loading ``state_dict`` into the model first.

        Runs on the worker thread after every request already submitted, so in-flight requests finish on
        the weights they started with. Tensors may be on any device (the trainer's, the CPU): each is copied onto
        the model's. ``state_dict`` may be partial (only the tensors that changed); keys
        must exist in the model with matching shapes, else :class:`ValidationFailed` and nothing changes.
        ``None`` only renames the served version (weights unchanged).
        """
        await self._run(self._swap, str(version), state_dict)

    def _swap(self, version: str, state_dict: dict | None) -> None:
        if state_dict is not None and self._adapters:
            raise Conflict(f"engine {self.name} serves LoRA adapters ({', '.join(sorted(self._adapters))}) on its base "
                           "weights; a full-weight swap would move the base under every one of them")
        if state_dict is not None:
            own = self._model.state_dict()
            unknown = sorted(k for k in state_dict if k not in own)
            if unknown:
                raise ValidationFailed(f"state_dict has keys the model lacks: {unknown[:5]}")
            bad = sorted(k for k, v in state_dict.items() if tuple(v.shape) != tuple(own[k].shape))
            if bad:
                raise ValidationFailed(f"state_dict shapes differ from the model's: {bad[:5]}")
            with torch.no_grad():
                for k, v in state_dict.items():
                    own[k].copy_(v.to(device=own[k].device, dtype=own[k].dtype))
            self._packed.clear()  # the packed copies describe the old weights
        self.version = version

    # ---- adapters ----------------------------------------------------------------------------------------
    async def load_adapter(self, name: str, version: str, adapter: AdapterWeights | None) -> None:
        """From the next request on, serve requests frozen on any of ``name``'s versions with ``adapter``, as
        ``version``.

        Queued on the worker like a request: requests already submitted finish on what they started with. A
        replacement is atomic: the new tensors are checked against the adapter's expected keys and shapes first
        (:class:`ValidationFailed`, nothing changes). ``adapter=None`` serves the base under ``version`` for
        ``name`` (a scenario rolled back to its start keeps its own version line)."""
        await self._run(self._guard, self._load_adapter, str(name), str(version), adapter)

    async def drop_adapter(self, name: str) -> None:
        """Forget adapter ``name``: requests frozen on its versions are served by the base (under :attr:`version`)."""
        await self._run(self._guard, self._drop_adapter, str(name))

    def adapters(self) -> dict[str, str]:
        """Adapter name -> the version it serves now."""
        return {name: a.version for name, a in self._adapters.items()}

    def _load_adapter(self, name: str, version: str, adapter: AdapterWeights | None) -> None:
        old = self._adapters.get(name)
        slot = None
        if adapter is not None:
            same = old is not None and old.slot is not None and old.config == adapter.config
            slot = old.slot if same else self._new_slot(adapter.config)
            try:
                self._set_adapter_tensors(slot, adapter.tensors)
            except BaseException:
                if not same:
                    self._delete_slot(slot)
                raise
        if old is not None and old.slot is not None and old.slot != slot:
            self._delete_slot(old.slot)
        self._adapters[name] = _Adapter(version, slot, adapter.config if adapter is not None else None)
        self._adapter_of[version] = name

    def _drop_adapter(self, name: str) -> None:
        old = self._adapters.pop(name, None)
        if old is not None and old.slot is not None:
            self._delete_slot(old.slot)
        for version in [v for v, n in self._adapter_of.items() if n == name]:
            del self._adapter_of[version]

    def _new_slot(self, config: dict):
        from peft import PeftConfig, get_peft_model

        try:
            peft_config = PeftConfig.from_peft_type(**{**config, "inference_mode": True})
        except (TypeError, ValueError) as exc:
            raise ValidationFailed(f"adapter config does not load: {exc}") from None
        self._slots += 1
        slot = f"reef_{self._slots}"
        if self._peft is None:
            self._transformers()
            self._peft = get_peft_model(self._model, peft_config, adapter_name=slot)
            self._peft.eval()
        else:
            self._peft.add_adapter(slot, peft_config)
        self._serving_slot = _UNKNOWN  # peft enables the slot it builds: decided again per request
        self._lean_slots.clear()
        return slot

    def _delete_slot(self, slot: str) -> None:
        if self._peft is None:
            return
        if set(self._peft.peft_config) == {slot}:
            self._peft.base_model.unload()  # the last one: back to the plain model (its layers, not merged)
            self._peft = None
        else:
            self._peft.delete_adapter(slot)
        self._serving_slot = _UNKNOWN
        self._lean_slots.clear()

    def _set_adapter_tensors(self, slot: str, tensors) -> None:
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        own = get_peft_model_state_dict(self._peft, adapter_name=slot)
        unknown = sorted(set(tensors) - set(own))
        missing = sorted(set(own) - set(tensors))
        if unknown or missing:
            raise ValidationFailed(f"adapter tensors do not fit the model: unknown {unknown[:3]}, "
                                   f"missing {missing[:3]}")
        bad = sorted(k for k, v in tensors.items() if tuple(v.shape) != tuple(own[k].shape))
        if bad:
            raise ValidationFailed(f"adapter tensor shapes differ from the model's: {bad[:3]}")
        with torch.no_grad():
            set_peft_model_state_dict(self._peft, {k: v.to(self.device) for k, v in tensors.items()},
                                      adapter_name=slot)

    def _enable(self, slot: str | None) -> None:
        """Worker thread: make ``slot`` the adapter the model applies (None: the base, every adapter disabled)."""
        if self._peft is None or slot == self._serving_slot:
            return
        tuner = self._peft.base_model
        if slot is None:
            tuner.disable_adapter_layers()
        else:
            tuner.enable_adapter_layers()
            self._peft.set_adapter(slot, inference_mode=True)
        self._serving_slot = slot

    def _serving(self, frozen: str | None) -> _Adapter | None:
        """The adapter a request frozen on ``frozen`` is served by (None: the base)."""
        return self._adapters.get(self._adapter_of.get(frozen)) if frozen is not None else None

    def _serve_as(self, frozen: str | None) -> str:
        """Worker thread: enable the adapter a request frozen on ``frozen`` is served by; the version it serves."""
        adapter = self._serving(frozen)
        if adapter is None:
            self._enable(None)
            return self.version
        self._enable(adapter.slot)
        return adapter.version

    # ---- requests ----------------------------------------------------------------------------------------
    def _params(self, body: dict) -> SamplingParams:
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValidationFailed("tools must be a list of tool objects", param="tools")
        return sampling_params(body, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                               top_p=self.top_p, model=self.name, one_choice="the local engine generates one choice")

    def _check_prompt_size(self, messages: list[dict], tools: Any) -> None:
        """Refuse, on the event loop and before any tokenizing, a prompt whose text alone could not fit the
        context even if every token stood for the longest token of the vocabulary (a lower bound on its token
        count); prompts under the bound are tokenized and checked exactly by :meth:`_start_row`."""
        if not self._max_len or self._tok is None:
            return
        chars = sum(len(m["content"]) for m in messages)
        if isinstance(tools, list):
            chars += sum(len(str(t)) for t in tools)
        if chars > self._max_len * self._max_token_chars:
            raise ValidationFailed(f"messages: the prompt ({chars} characters) cannot fit the model's context of "
                                   f"{self._max_len} tokens")

    def _prompt_ids(self, messages: list[dict], tools: list | None) -> list[int]:
        kwargs = {"tools": tools} if tools else {}
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    # ---- batching (called by the worker, on its thread) -----------------------------------------------------
    def fits(self, keys: list, job: _Job):
        """The batch key of ``job`` when it may join rows keyed ``keys``: rows share a step only on the lean pass,
        served by the same adapter slot; transformers' forward serves one row at a time."""
        if len(keys) >= self.max_batch_size:
            return None
        adapter = self._serving(job.frozen)
        slot = adapter.slot if adapter is not None else None
        key = ("lean", slot) if self._lean_for(slot) else object()  # object(): equal to no other key
        if keys and (self.max_batch_size == 1 or any(k != key for k in keys)):
            return None
        return key

    def _lean_for(self, slot: str | None) -> bool:
        """Whether the lean pass serves requests on adapter ``slot`` (not when off, unsupported, or e.g. DoRA)."""
        if not self.fast_decode or self._fast_unsupported:
            return False
        if slot not in self._lean_slots:
            try:
                FastDecoder(self._model, slot, 1, self.device, None)
                self._lean_slots[slot] = True
            except Exception:  # NotImplementedError (e.g. DoRA), or anything odd: transformers' forward serves it
                self._lean_slots[slot] = False
        return self._lean_slots[slot]

    def admit(self, jobs: list[tuple[_Job, Any]]) -> list[_Row | None]:
        """Tokenize and prefill ``jobs`` (with their batch keys, all equal): their rows, None for each that ended here
        (refused, failed, or already over). The prompts of lean rows are prefilled together."""
        rows: list[_Row | None] = []
        for job, key in jobs:
            try:
                row = self._guard(self._start_row, job, isinstance(key, tuple))
                if row.max_new <= 0:
                    self._end_row(row)
                    row = None
            except BaseException as exc:  # handed to the request's consumer
                job.done(exc)
                row = None
            rows.append(row)
        started = [row for row in rows if row is not None]
        if started:
            try:
                self._guard(self._prefill, started)
            except BaseException as exc:
                for row in started:
                    row.job.done(exc)
                return [None] * len(rows)
        return rows

    def step(self, rows: list[_Row]) -> list[_Row]:
        """One token for every row (from its current logits), then one forward for the rows still going."""
        going = []
        for row in rows:
            try:
                over = self._take(row)
            except BaseException as exc:  # a tokenizer failure: this row's, not the batch's
                row.job.done(UpstreamError(f"local generation failed: {exc.__class__.__name__}: {exc}"))
                continue
            if over:
                self._end_row(row)
            else:
                going.append(row)
        if not going:
            return going
        try:
            self._guard(self._forward, going)
        except BaseException as exc:
            for row in going:
                row.job.done(exc)
            return []
        return going

    @torch.inference_mode()
    def _start_row(self, job: _Job, lean: bool) -> _Row:
        p = job.params
        res = _Result(prompt_ids=self._prompt_ids(job.messages, job.tools), version=self.version)
        max_new = p.max_new
        if self._max_len:
            room = self._max_len - len(res.prompt_ids)
            if room <= 0:
                raise ValidationFailed(f"messages: the prompt of {len(res.prompt_ids)} tokens fills the model's context "
                                       f"of {self._max_len} tokens")
            max_new = min(max_new, room)
        res.version = self._serve_as(job.frozen)
        if p.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(p.seed)
        else:
            gen = self._gen
        if job.started is not None:
            job.started(res.version)
        k = min(self.top_k_logprobs, int(self._model.config.vocab_size)) if self.top_k_logprobs else 0
        dec = self._decoder(len(res.prompt_ids) + max_new) if lean else None
        self.decode_path = "transformers" if dec is None else "lean"
        return _Row(job, res, _TextStream(self._tok, p.stops), gen, max_new, k, dec)

    @torch.inference_mode()
    def _prefill(self, rows: list[_Row]) -> None:
        """Every row's first logits, from its prompt: lean rows together (:func:`prefill_rows`), others one by one
        through transformers' forward."""
        lean = [row for row in rows if row.dec is not None]
        if lean:
            logits = prefill_rows([row.dec for row in lean], [row.res.prompt_ids for row in lean])
            for r, row in enumerate(lean):
                row.logits = logits[r]
        for row in rows:
            if row.dec is None:
                row.out = self._transformers()(input_ids=torch.tensor([row.res.prompt_ids], device=self.device),
                                               use_cache=True, **self._prefill_kw)
                row.logits = row.out.logits[0, -1].float()

    @torch.inference_mode()
    def _take(self, row: _Row) -> bool:
        """Sample the row's next token from its logits and release its text; True when the generation is over."""
        p, res, logits = row.job.params, row.res, row.logits
        logp = torch.log_softmax(logits, dim=-1)
        if row.k:
            vals, idx = torch.topk(logp, row.k)
            row.top_vals.append(vals)
            row.top_ids.append(idx)
        tid = _sample(logits, p.temperature, p.top_p, row.gen)
        res.output_ids.append(tid)
        res.logprobs.append(float(logp[tid]))
        if tid in self._eos:
            res.finish_reason = "stop"
            return True
        if p.logprobs:
            row.pending.append(_lp_entry(self._tok, tid, logp, p.top_logprobs))
        piece = row.text.add(tid)
        if piece and row.job.emit is not None:
            row.job.emit(piece, row.pending)
            row.pending = []
        if row.text.stopped:
            res.finish_reason = "stop"
            return True
        if row.job.cancel.is_set():
            res.finish_reason = "stop"
            self.stats["cancelled"] += 1
            return True
        return len(res.output_ids) >= row.max_new

    @torch.inference_mode()
    def _forward(self, rows: list[_Row]) -> None:
        """The next logits of every row, from its last token: one forward for all (lean rows share weights)."""
        self.stats["decode_steps"] += 1
        self.stats["max_rows"] = max(self.stats["max_rows"], len(rows))
        if rows[0].dec is None:  # transformers' forward: always alone
            (row,) = rows
            ckw = self._cache_kw
            row.out = self._model(input_ids=torch.tensor([[row.res.output_ids[-1]]], device=self.device),
                                  use_cache=True, **{ckw: getattr(row.out, ckw)})
            row.logits = row.out.logits[0, -1].float()
            return
        last = torch.tensor([r.res.output_ids[-1] for r in rows], device=self.device)
        logits = step_rows([r.dec for r in rows], last)
        for r, row in enumerate(rows):
            row.logits = logits[r]

    def _end_row(self, row: _Row) -> None:
        """Finish a row: flush its text, gather its top-K, hand its result to its consumer."""
        res, job = row.res, row.job
        try:
            self.stats["generations"] += 1
            self.stats["output_tokens"] += len(res.output_ids)
            if row.k:
                ids = torch.stack(row.top_ids).flatten().tolist() if row.top_ids else []
                vals = torch.stack(row.top_vals).flatten().tolist() if row.top_vals else []
                res.top_k = TopK(k=row.k, ids=ids, logprobs=vals)
            tail = row.text.finish()
            if (tail or row.pending) and job.emit is not None:
                job.emit(tail, row.pending)
            res.text = row.text.full
            if job.params.logprobs:
                res.lp_entries = row.pending  # non-streamed: every entry (emit was None)
        except BaseException as exc:
            job.done(UpstreamError(f"local generation failed: {exc.__class__.__name__}: {exc}"))
            return
        job.done(res)

    def _decoder(self, length: int) -> FastDecoder | None:
        """Worker thread: the lean forward pass for this generation (after :meth:`_serve_as` chose the adapter),
        or None to use transformers' forward (unsupported model or adapter, or :attr:`fast_decode` off)."""
        if not self.fast_decode or self._fast_unsupported:
            return None
        slot = self._serving_slot if isinstance(self._serving_slot, str) else None
        try:
            return FastDecoder(self._model, slot, length, self.device, self._packed)
        except NotImplementedError:  # e.g. a DoRA adapter: this generation only
            return None

    def _submit(self, body: dict, cancel: threading.Event, done, emit=None, started=None,
                frozen: str | None = None) -> None:
        """Queue a generation for ``body`` (validated on the loop before this)."""
        if self._worker is None:
            raise UpstreamError(f"engine {self.name} is not started")
        job = _Job(_chat_messages(body), request_tools(body)[0], self._params(body), cancel, done, emit, started,
                   frozen)
        self._worker.generate(job)

    def _calls(self, body: dict) -> ToolCallStream:
        """The splitter of this request's generated text into content and tool calls (a pass-through when the
        request offers no tools or the model's calls are not parsed)."""
        return ToolCallStream(self.tool_parser if request_tools(body)[1] else None)

    def _completion_body(self, res: _Result, p: SamplingParams, calls: ToolCallStream, rid: str,
                         created: int) -> dict:
        logprobs = {"content": res.lp_entries, "refusal": None} if p.logprobs else None
        events = calls.feed(res.text) + calls.finish()
        message = {"role": "assistant", "content": res.text, "refusal": None, "annotations": []}
        if calls.calls:
            message["content"] = "".join(value for kind, value in events if kind == "text") or None
            message["tool_calls"] = calls.calls
        return {
            "id": rid, "object": "chat.completion", "created": created, "model": p.model,
            "system_fingerprint": f"reef-{res.version}",
            "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                         "finish_reason": finish_reason(res.finish_reason, calls.calls)}],
            "usage": _usage(res),
        }

    async def complete(self, req: EngineRequest) -> EngineResponse:
        self.check_dialect(req)
        if req.route == "count_tokens":
            return await self.count_tokens(req)
        p = self._params(req.body)
        calls = self._calls(req.body)
        self._check_prompt_size(_chat_messages(req.body), request_tools(req.body)[0])  # on the loop, before queueing
        cancel = threading.Event()
        future: concurrent.futures.Future = concurrent.futures.Future()

        def done(outcome) -> None:
            if not future.done():  # not cancelled meanwhile
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)

        self._active.add(cancel)
        try:
            self._submit(req.body, cancel, done, frozen=req.version)
            res = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            cancel.set()
            raise
        finally:
            self._active.discard(cancel)
        body = self._completion_body(res, p, calls, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()))
        tokens = res.tokens()
        return EngineResponse(200, body, {}, tokens=tokens, version=res.version)

    @staticmethod
    def _guard(fn, *args):
        """Run ``fn`` on the worker, turning unexpected failures into UpstreamError (Reef errors pass)."""
        try:
            return fn(*args)
        except ReefError:
            raise
        except Exception as exc:  # torch / tokenizer failure: the engine failed, not the request
            raise UpstreamError(f"local generation failed: {exc.__class__.__name__}: {exc}") from exc

    async def stream(self, req: EngineRequest) -> AsyncIterator[StreamEvent]:
        self.check_dialect(req)
        p = self._params(req.body)
        calls = self._calls(req.body)
        self._check_prompt_size(_chat_messages(req.body), request_tools(req.body)[0])
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # loop closed: nobody is listening any more
                cancel.set()

        def done(outcome) -> None:  # an exception is raised at the consumer
            put(("error", outcome) if isinstance(outcome, BaseException) else ("done", outcome))

        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": p.model}

        def chunk(delta: dict, finish: str | None = None, lps: list | None = None,
                  fp: str | None = None) -> StreamEvent:
            choice = {"index": 0, "delta": delta,
                      "logprobs": {"content": lps, "refusal": None} if p.logprobs and lps is not None else None,
                      "finish_reason": finish}
            return StreamEvent(None, dict(base, system_fingerprint=fp, choices=[choice]))

        self._active.add(cancel)
        try:
            self._submit(req.body, cancel, done, lambda text, lps: put(("text", (text, lps))),
                         lambda version: put(("start", version)), req.version)
            fp = None
            held: list[dict] = []  # log-prob entries of text the tool-call splitter still holds
            sent_calls = 0

            def deltas(events: list) -> list[StreamEvent]:
                nonlocal held, sent_calls
                out = []
                for kind, value in events:
                    if kind == "text":
                        out.append(chunk({"content": value}, lps=held, fp=fp))
                        held = []
                    else:  # a whole call as soon as its block closed: id, name and arguments in one delta
                        out.append(chunk({"tool_calls": [{"index": sent_calls, **value}]}, fp=fp))
                        sent_calls += 1
                return out

            while True:
                kind, payload = await queue.get()
                if kind == "start":
                    fp = f"reef-{payload}"
                    yield chunk({"role": "assistant", "content": ""}, fp=fp)
                elif kind == "text":
                    text, lps = payload
                    held += lps
                    for event in deltas(calls.feed(text)):
                        yield event
                elif kind == "error":
                    raise payload
                else:
                    res: _Result = payload
                    fp = f"reef-{res.version}"
                    for event in deltas(calls.finish()):
                        yield event
                    if held and p.logprobs:  # entries of text that ended up inside a call
                        yield chunk({"content": ""}, lps=held, fp=fp)
                    yield chunk({}, finish_reason(res.finish_reason, calls.calls), fp=fp)
                    if p.include_usage:
                        yield StreamEvent(None, dict(base, system_fingerprint=fp, choices=[], usage=_usage(res)))
                    yield StreamEvent(TOKENS_EVENT, res.tokens().to_event())
                    yield StreamEvent(None, "[DONE]")
                    return
        finally:
            cancel.set()  # consumer gone or stream over: stop generating
            self._active.discard(cancel)

    async def count_tokens(self, req: EngineRequest) -> EngineResponse:
        body = req.body
        if req.dialect == "anthropic":
            body = anthropic_count_tokens_to_openai(body)
        messages = _chat_messages(body)
        tools = request_tools(body)[0]
        self._check_prompt_size(messages, tools)
        n = await self._run(self._guard, lambda: len(self._prompt_ids(messages, tools)))
        return EngineResponse(200, {"input_tokens": n}, {TOKEN_COUNT_HEADER: "tokenizer"}, version=self.version)


def _usage(res: _Result) -> dict:
    return {"prompt_tokens": len(res.prompt_ids), "completion_tokens": len(res.output_ids),
            "total_tokens": len(res.prompt_ids) + len(res.output_ids)}


def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    """One token from ``softmax(logits / temperature)`` restricted to the top-p nucleus (greedy at 0).

    Exact for the distribution, and cheap: the nucleus is found among the most likely tokens (a ``topk`` widened
    until it holds top_p of the mass), not by sorting the vocabulary, and the draw is one uniform against the
    cumulative mass. (torch.multinomial draws an exponential per vocabulary entry: ~2.5 ms a token on SmolLM2's
    49k vocabulary, ~9 ms with the sort for top-p, against ~12 ms for the whole forward.) A given seed yields the
    same tokens on every run (not the tokens the earlier multinomial sampler drew for it)."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(_serial(lambda piece: piece.float() / temperature, logits), dim=-1)
    if top_p >= 1.0:
        return _draw(probs, gen)
    n = probs.shape[-1]
    k = min(64, n)
    while True:
        vals, idx = torch.topk(probs, k)  # descending
        mass = torch.cumsum(vals, dim=-1)
        if k == n or float(mass[-1]) >= top_p:
            break
        k = min(n, k * 8)
    keep = int(((mass - vals) < top_p).sum())  # the smallest prefix reaching top_p (top_p = 0: the top token)
    return int(idx[_draw(vals[:max(keep, 1)], gen)])


def _draw(p: torch.Tensor, gen: torch.Generator) -> int:
    """Index i with probability p[i] / sum(p), from one uniform draw of ``gen`` (inverse of the cumulative mass)."""
    mass = torch.cumsum(_serial(lambda piece: piece.double(), p), dim=-1)
    u = torch.rand((), generator=gen, dtype=torch.float64, device=p.device) * mass[-1]
    return min(int(torch.searchsorted(mass, u, right=True)), p.shape[-1] - 1)


#: the most elements one elementwise torch call of the sampler gets: below ATen's grain (32,768) it runs on the
#: calling thread. A parallel call leaves torch's OpenMP workers spinning for a while afterwards, on the core the C
#: kernel's threads need for the next decode step (SmolLM2, 2 cores: an 8-row step took 14.4 ms, 16.6 ms after one
#: division of a 49k-entry vocabulary's logits)
_SERIAL = 16384


def _serial(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``op(x)`` for an elementwise ``op``, computed in pieces of at most :data:`_SERIAL` elements (bitwise the
    same)."""
    return op(x) if x.numel() <= _SERIAL else torch.cat([op(piece) for piece in x.split(_SERIAL)])


def _lp_entry(tok, tid: int, logp: torch.Tensor, top: int) -> dict:
    def item(i: int, lp: float) -> dict:
        s = tok.decode([i])
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    entry = item(tid, float(logp[tid]))
    entry["top_logprobs"] = []
    if top:
        vals, idx = torch.topk(logp, top)
        entry["top_logprobs"] = [item(int(i), float(v)) for v, i in zip(vals, idx)]
    return entry
