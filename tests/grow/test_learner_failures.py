"""A trainer that keeps failing cannot stall its scenario: the batch is dropped after a few attempts."""

from __future__ import annotations

import time

import httpx

from reef_core import hookimpl
from reef_core.config import compose_config
from reef_core.grow.trainer import Trainer
from reef_core.plugins import PluginManager
from reef_core.serve.app import create_app
from reef_core.loop.assemble import build_deployment
from reef_core.testing.fake_upstream import serve_asgi


class ExplodingTrainer(Trainer):
    calls = 0

    def train(self, batch, ctx):
        ExplodingTrainer.calls += 1
        raise RuntimeError("the trainer broke")


class ExplodingPlugin:
    @staticmethod
    @hookimpl
    def reef_register_trainers(register):
        register("exploding", lambda **_: ExplodingTrainer())


def test_failing_batch_is_dropped_after_retries(tmp_path, fake_upstream_url):
    pm = PluginManager(extra_plugins=(ExplodingPlugin,))
    cfg = compose_config(["engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                          f"storage.data_dir={tmp_path}", "recipe.processor=per_report",
                          "recipe.trainer=exploding", "+recipe.processor_options.batch_size=1"], pm)
    with serve_asgi(create_app(build_deployment(cfg, pm)), lifespan="on") as url:
        headers = {"x-reef-scenario": "broken"}
        chat = httpx.post(f"{url}/v1/chat/completions", headers=headers,
                          json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        receipt = chat.headers["x-reef-agent-record-id"]
        assert httpx.post(f"{url}/reef/report", headers=headers,
                          json={"score": 1, "references": [receipt]}).status_code == 200
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            commits = httpx.get(f"{url}/reef/scenarios/broken/commits").json()["commits"]
            if commits:
                break
            time.sleep(0.1)
        assert len(commits) == 1 and "the trainer broke" in commits[0]["metrics"]["train_error"]
        assert set(commits[0]["consumed_ids"]) >= {receipt}
        status = httpx.get(f"{url}/reef/scenarios/broken/status").json()
        assert status["processor"]["dropped"] == {"trainer_failed": 1}
        assert ExplodingTrainer.calls == 3 and status["counters"]["errors"] == 3
        # Serving was never affected.
        assert httpx.post(f"{url}/v1/chat/completions", headers=headers,
                          json={"model": "m", "messages": [{"role": "user", "content": "still"}]}).status_code == 200
