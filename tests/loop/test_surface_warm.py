"""Surfaces warm up once the engine is loaded, on a thread of their own, without holding readiness."""

from __future__ import annotations

import asyncio
import threading

from reef_core.config import compose_config
from reef_core.loop.assemble import build_deployment


class _Surface:
    kind = "none"

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.entered = threading.Event()
        self.release = threading.Event()
        self.thread: str | None = None
        self.engine_started: bool | None = None
        self.engine = None

    def warm(self) -> None:
        self.thread = threading.current_thread().name
        self.engine_started = getattr(self.engine, "_client", None) is not None
        self.entered.set()
        if self.fail:
            raise RuntimeError("warm-up failed")
        assert self.release.wait(30)


def _deployment(tmp_path):
    cfg = compose_config(["engine.kind=upstream", "engine.upstream_url=http://127.0.0.1:9",
                          f"storage.data_dir={tmp_path}"])
    return build_deployment(cfg)


def test_start_warms_every_surface_on_a_thread_and_does_not_wait_for_it(tmp_path):
    dep = _deployment(tmp_path)
    failing, slow = _Surface(fail=True), _Surface()
    failing.engine = slow.engine = dep.engine
    dep._surfaces.update({("failing", "{}"): failing, ("slow", "{}"): slow})

    async def scenario():
        await dep.start()  # returns while `slow` is still warming: readiness does not wait for it
        assert slow.entered.wait(30) and not slow.release.is_set()
        slow.release.set()
        await dep.stop()

    asyncio.run(scenario())
    # A failing surface does not stop the others; both ran off the event loop's thread.
    assert failing.entered.is_set() and failing.thread == slow.thread == "reef-surface-warm"
    assert slow.engine_started  # after the engine's start: the warm-up does not compete with the model load
