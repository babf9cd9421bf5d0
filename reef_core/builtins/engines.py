"""Built-in inference engines: ``local`` (embedded transformers model) and ``upstream`` (proxy)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from .. import hookimpl
from ..errors import ConfigError
from ..extras import require


def model_cache_dir(config) -> Path | None:
    cache = config.model_cache_dir or os.environ.get("REEF_MODEL_CACHE")
    return Path(cache) if cache else None


def make_local_engine(config, data_dir: Path):
    require("local", "engine.kind=local")
    if str(config.model) == "smollm2":
        require("demo", "engine.model=smollm2")
    from ..engines.local import LocalEngine
    from ..grow.device import engine_device
    from ..grow.models import resolve_model

    device = engine_device(config)  # before the model is fetched or converted: a missing device fails fast
    model_dir = resolve_model(str(config.model), Path(data_dir), model_cache_dir(config))
    # Versions are "<incarnation>:<sequence>": a fresh incarnation per engine start, so samples
    # produced by weights of an earlier process are never mistaken for current ones.
    return LocalEngine(
        model_dir,
        version=f"{uuid.uuid4().hex[:8]}:0",
        max_new_tokens=int(config.max_new_tokens),
        temperature=float(config.temperature),
        top_p=float(config.top_p),
        seed=config.seed,
        device=device,
        top_k_logprobs=int(config.top_k_logprobs),
    )


def make_upstream_engine(config, data_dir: Path):
    from ..engines.upstream import UpstreamEngine

    url = config.upstream_url or os.environ.get("REEF_UPSTREAM_URL")
    if not url:
        raise ConfigError("engine.kind=upstream needs engine.upstream_url (or REEF_UPSTREAM_URL)")
    if config.upstream_dialect not in ("openai", "anthropic"):
        raise ConfigError(f"engine.upstream_dialect must be 'openai' or 'anthropic', not {config.upstream_dialect!r}")
    return UpstreamEngine(
        url,
        api_key=config.upstream_api_key or os.environ.get("REEF_UPSTREAM_API_KEY"),
        dialect=config.upstream_dialect,
        timeout_s=float(config.timeout_s),
        model=config.upstream_model or os.environ.get("REEF_UPSTREAM_MODEL"),
    )


@hookimpl
def reef_register_engines(register):
    register("local", make_local_engine, description="embedded transformers model on CPU or one GPU")
    register("upstream", make_upstream_engine, description="any OpenAI- or Anthropic-compatible endpoint")
