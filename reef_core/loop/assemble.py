"""Assemble a deployment from the composed config: engine, artifact store, record store."""

from __future__ import annotations

import asyncio
from pathlib import Path

from ..config.schema import ReefConfig


def build_deployment(cfg: ReefConfig, plugin_manager=None, role: str | None = None, preload: bool = False,
                     before_build=None):
    """The deployment ``cfg`` describes; ``role`` as in :class:`~reef_core.loop.deployment.Deployment`.

    ``preload``: the engine starts loading (:meth:`~reef_core.engines.base.Engine.preload`) as soon as it exists,
    so a model loads while the record store opens and the caller builds its app; for a caller outside an event
    loop (``reef serve``), which then starts the deployment. ``before_build`` (a callable) runs once the config
    has passed its checks, before anything is written or loaded (``reef serve``: whether its port is free)."""
    from ..config.recipes import check_components, recipe_bindings
    from ..models.device import check_devices
    from ..observe.records import RecordStore
    from ..plugins import get_plugin_manager
    from .deployment import Deployment

    # A device the machine lacks is a config error before anything is built or written.
    check_devices(cfg)
    tracing = open_tracing(cfg)  # its extra and its headers' variables, before anything is written
    pm = plugin_manager or get_plugin_manager()
    # So is a component's option it would refuse (a typo'd key): before the model loads, not on every step.
    for binding in recipe_bindings(cfg, pm).values():
        check_components(binding, pm)
    if before_build is not None:
        before_build()
    data_dir = Path(cfg.storage.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    engine = pm.create("engine", cfg.engine.kind, config=cfg.engine, data_dir=data_dir)
    if preload:
        engine.preload()
    try:
        artifacts = pm.create("artifact_store", cfg.storage.artifact_store, config=cfg.storage, data_dir=data_dir)
        options = {"schema": cfg.storage.records_schema} if cfg.storage.records_schema else {}
        store = RecordStore.open(cfg.storage.records_url, data_dir, **options)
        try:
            return Deployment(cfg, pm, store, engine, artifacts, role=role, tracing=tracing)
        except BaseException:
            store.close()
            raise
    except BaseException:
        if preload:
            asyncio.run(engine.close())  # ends the load begun above
        raise


def open_tracing(cfg: ReefConfig):
    """The OTLP exporter ``observability.tracing`` asks for (not started), or None when it is off; raises ConfigError
    naming the missing extra or an unset header variable."""
    settings = cfg.observability.tracing
    if not settings.enabled:
        return None
    from ..config.tracing import check_tracing_start, endpoint_url
    from ..observe.tracing import Tracing

    headers = check_tracing_start(settings)
    engine = cfg.engine
    provider = engine.upstream_dialect if engine.kind == "upstream" else engine.kind
    return Tracing(settings, endpoint_url(settings), headers, provider=provider)
