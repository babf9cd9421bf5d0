"""``reef learn``: the learners as their own process, beside serving replicas.

Replicas (``reef serve server.learner=false``) store records and serve heads; this process trains. With a
PostgreSQL record store, it trains a scenario only while it holds the scenario's lease
(:mod:`reef_core.loop.lease`): start two and one is active per scenario, the other a standby that takes over,
recovering from the commit log, when the active one dies. Every ``server.follow_interval_s`` it looks for new
scenarios, free leases and new records (they arrive through other processes). It publishes through the shared
artifact repository (``storage.artifact_repository``) and tells the replicas with a PostgreSQL ``NOTIFY``.

SIGTERM or SIGINT stops it after the running step; exit code 1 when the lease session to PostgreSQL is lost.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from ..config.schema import ReefConfig
from ..errors import ConfigError, ReefError

log = logging.getLogger("reef.learn")


def run_learn(cfg: ReefConfig) -> int:
    """Run the learners until a signal; 0 on a clean stop, 1 when the process had to give its leases up."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    return asyncio.run(_learn(cfg))


async def _learn(cfg: ReefConfig) -> int:
    from .assemble import build_deployment

    if cfg.recipe.name == "none":
        raise ConfigError("reef learn needs a recipe to train (e.g. +recipe=sao)")
    deployment = build_deployment(cfg, role="learn")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    code = 0
    try:
        await deployment.start()
        deployment.pm.notify("reef_startup", config=cfg)
        log.info("reef learn: started (leases %s)", "on PostgreSQL" if deployment.shared else "off: SQLite record store")
        while not stop.is_set():
            try:
                await asyncio.to_thread(deployment.learn_round)
            except ReefError as exc:
                log.error("reef learn: %s", exc.message)
                code = 1
                break
            try:
                await asyncio.wait_for(stop.wait(), cfg.server.follow_interval_s)
            except asyncio.TimeoutError:
                pass
    finally:
        await deployment.stop()
    return code
