"""Built-in inference engines: ``local`` (embedded transformers model), ``upstream`` (proxy), ``sglang`` and
``vllm`` (an SGLang or vLLM server driven over HTTP)."""

from __future__ import annotations

import os
from pathlib import Path

from .. import hookimpl
from ..errors import ConfigError
from ..extras import require
from ..versions import ServedVersion


def sampling_defaults(config, model_dir: Path) -> dict[str, float]:
    """``engine.temperature`` / ``engine.top_p`` where set, else the model's generation config, else 1.0."""
    from ..models.loading import generation_defaults

    model = generation_defaults(model_dir)
    out = {}
    for key, hi in (("temperature", 2.0), ("top_p", 1.0)):
        value = getattr(config, key)
        if value is None:
            out[key] = model.get(key, 1.0)
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= hi:
            raise ConfigError(f"engine.{key} must be a number in [0, {hi}], got {value!r}")
        else:
            out[key] = float(value)
    return out


def make_local_engine(config, data_dir: Path):
    require("local", "engine.kind=local")
    if str(config.model) == "smollm2":
        require("demo", "engine.model=smollm2")
    from ..engines.local import LocalEngine
    from ..models.device import engine_device
    from ..models.loading import model_cache_dir, resolve_model

    device = engine_device(config)  # before the model is fetched or converted: a missing device fails fast
    model_dir = resolve_model(str(config.model), Path(data_dir), model_cache_dir(config))
    # A fresh incarnation per engine start (reef_core.versions).
    return LocalEngine(
        model_dir,
        version=str(ServedVersion.fresh()),
        max_new_tokens=int(config.max_new_tokens),
        **sampling_defaults(config, model_dir),
        seed=config.seed,
        device=device,
        top_k_logprobs=int(config.top_k_logprobs),
        tool_call_parser=str(config.tool_call_parser),
        max_batch_size=config.max_batch_size,
        num_threads=config.num_threads,
    )


def make_upstream_engine(config, data_dir: Path):
    from ..engines.upstream import UpstreamEngine

    url = config.upstream_url or os.environ.get("REEF_UPSTREAM_URL")
    if not url:
        raise ConfigError("engine.kind=upstream needs engine.upstream_url (or REEF_UPSTREAM_URL)")
    if config.upstream_dialect not in ("openai", "anthropic"):
        raise ConfigError(f"engine.upstream_dialect must be 'openai' or 'anthropic', not {config.upstream_dialect!r}")
    if config.upstream_tokenizer and config.upstream_dialect != "openai":
        raise ConfigError("engine.upstream_tokenizer needs engine.upstream_dialect=openai (an Anthropic provider "
                          "counts tokens itself)")
    if config.upstream_responses and config.upstream_dialect != "openai":
        raise ConfigError("engine.upstream_responses needs engine.upstream_dialect=openai (an Anthropic provider does "
                          "not serve /v1/responses)")
    return UpstreamEngine(
        url,
        api_key=config.upstream_api_key or os.environ.get("REEF_UPSTREAM_API_KEY"),
        dialect=config.upstream_dialect,
        timeout_s=float(config.timeout_s),
        model=config.upstream_model or os.environ.get("REEF_UPSTREAM_MODEL"),
        responses=bool(config.upstream_responses),
        tokenizer=config.upstream_tokenizer,
    )


def make_sglang_engine(config, data_dir: Path):
    """``engine.kind=sglang``: an SGLang server over HTTP (``engine.url``, or started by ``engine.launch``)."""
    from ..engines.sglang import SGLangEngine

    return _make_remote_engine(config, data_dir, "sglang", SGLangEngine)


def make_vllm_engine(config, data_dir: Path):
    """``engine.kind=vllm``: a vLLM OpenAI server over HTTP (``engine.url``, or started by ``engine.launch``)."""
    from ..engines.vllm import VLLMEngine

    return _make_remote_engine(config, data_dir, "vllm", VLLMEngine)


def _make_remote_engine(config, data_dir: Path, kind: str, cls):
    """An HTTP serving engine of ``kind`` from ``engine.*`` (the keys SGLang and vLLM share)."""
    require("local", f"engine.kind={kind}")  # the tokenizer and the trainer's torch stack
    from ..engines.launch import launcher_from_config
    from ..engines.untie import ties_embeddings, untied_copy
    from ..models.loading import model_cache_dir, resolve_model

    if str(config.model) == "smollm2":
        require("demo", "engine.model=smollm2")
    # engine.model is the served model's local directory: its tokenizer renders prompts, its weights are the
    # trainer's base and the files a published release is written over.
    model_dir = resolve_model(str(config.model), Path(data_dir), model_cache_dir(config))
    options = remote_options(config, model_dir)
    weights_dir = Path(config.weights_dir) if config.weights_dir else Path(data_dir) / "engine-weights"
    served_dir = model_dir
    if kind == "vllm" and config.launch and ties_embeddings(model_dir):
        # vLLM reloads a tied output head from nothing: the managed server serves an untied copy (engines/untie.py).
        served_dir = untied_copy(model_dir, weights_dir.absolute() / "base-untied")
    launcher = launcher_from_config(config.launch, served_dir, kind=kind)
    url = config.url or os.environ.get("REEF_ENGINE_URL")
    if launcher is not None:
        if url:
            raise ConfigError("engine.url and engine.launch exclude each other: launch starts its own server")
        url = launcher.url
    if not url:
        raise ConfigError(f"engine.kind={kind} needs engine.url (or REEF_ENGINE_URL), or engine.launch to start one")
    if not str(url).startswith(("http://", "https://")):
        raise ConfigError(f"engine.url must be an http(s) URL, not {url!r}")
    return cls(str(url), model_dir, version=str(ServedVersion.fresh()), weights_dir=weights_dir, options=options,
               launcher=launcher)


def remote_options(config, model_dir: Path):
    """The tunables of an HTTP serving engine from ``engine.*`` (the sampling defaults as :func:`sampling_defaults`
    finds them); :class:`~reef_core.engines.remote.RemoteOptions` checks their ranges."""
    from ..engines.remote import RemoteOptions

    return RemoteOptions(
        timeout_s=float(config.timeout_s),
        ready_timeout_s=float(config.ready_timeout_s),
        retry_timeout_s=float(config.retry_timeout_s) if config.retry_timeout_s is not None else None,
        drain_timeout_s=float(config.drain_timeout_s),
        max_new_tokens=int(config.max_new_tokens),
        **sampling_defaults(config, model_dir),
        seed=config.seed,
        top_k_logprobs=int(config.top_k_logprobs),
        tool_call_parser=str(config.tool_call_parser),
        max_loaded_loras=int(config.max_loaded_loras),
    )


@hookimpl
def reef_register_engines(register):
    register("local", make_local_engine, description="embedded transformers model on CPU or one GPU")
    register("upstream", make_upstream_engine, description="any OpenAI- or Anthropic-compatible endpoint")
    register("sglang", make_sglang_engine,
             description="an SGLang server over HTTP: token capture, versioned weight updates, per-version LoRA")
    register("vllm", make_vllm_engine,
             description="a vLLM OpenAI server over HTTP: token capture, versioned weight updates, per-version LoRA")
