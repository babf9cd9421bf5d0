"""Deployment.record_stored when its caller is cancelled (the client went away while the record was queued): the
record is stored and plugins hear of it all the same."""

from __future__ import annotations

import asyncio
import threading

import pytest

from reef_core import hookimpl
from reef_core.config import compose_config
from reef_core.loop.assemble import build_deployment
from reef_core.observe.model import Record
from reef_core.plugins import PluginManager
from reef_core.testing.fixtures import wait_until


class _Listener:
    stored: list[str] = []

    @staticmethod
    @hookimpl
    def reef_record_stored(record):
        _Listener.stored.append(record.record_id)


def test_a_cancelled_caller_still_gets_its_record_stored_and_announced(tmp_path):
    pm = PluginManager(load_entry_points=False, extra_plugins=(_Listener,))
    cfg = compose_config(["engine.kind=upstream", "engine.upstream_url=http://127.0.0.1:9",
                          f"storage.data_dir={tmp_path}"], pm)
    deployment = build_deployment(cfg, pm)
    store = deployment.store
    gate = threading.Event()
    held = store._writer.submit_call(lambda conn: gate.wait(30))  # the writer is busy until the gate opens
    record = Record(record_id="left-early", scenario="s", kind="inference", payload={"response": None},
                    complete=False)

    async def caller_leaves():
        task = asyncio.ensure_future(deployment.record_stored(record))
        await asyncio.sleep(0)  # queued behind the held call
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        # The loop keeps running: the writer hands the outcome back to it, and the plugin hears of the record.
        await asyncio.to_thread(wait_until, lambda: "left-early" in _Listener.stored, 30)

    try:
        asyncio.run(caller_leaves())
        held.result(30)
        assert store.get("s", "left-early") is not None
    finally:
        store.close()
