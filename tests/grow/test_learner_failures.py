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
from reef_core.testing.fixtures import wait_until


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


class BadTreeTrainer(Trainer):
    """Proposes a harness tree the harness surface cannot serve (a path escaping the tree)."""

    artifact_kind = "harness"

    def train(self, batch, ctx):
        from reef_core.grow.trainer import CandidateUpdate

        return CandidateUpdate(files={"../outside.md": b"escape"})


class BadTreePlugin:
    @staticmethod
    @hookimpl
    def reef_register_trainers(register):
        register("bad_tree", lambda **_: BadTreeTrainer())


def test_candidate_its_surface_refuses_is_rejected_not_published(tmp_path, fake_upstream_url):
    """Surface.validate is the last check before a release is written: a refused candidate is a
    rejection in the commit log, and no release exists."""
    pm = PluginManager(extra_plugins=(BadTreePlugin,))
    cfg = compose_config(["engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                          f"storage.data_dir={tmp_path}", "recipe.processor=per_report", "recipe.surface=harness",
                          "recipe.trainer=bad_tree", "+recipe.processor_options.batch_size=1"], pm)
    with serve_asgi(create_app(build_deployment(cfg, pm)), lifespan="on") as url:
        headers = {"x-reef-scenario": "refused"}
        chat = httpx.post(f"{url}/v1/chat/completions", headers=headers,
                          json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        receipt = chat.headers["x-reef-agent-record-id"]
        assert httpx.post(f"{url}/reef/report", headers=headers,
                          json={"score": 1, "references": [receipt]}).status_code == 200
        commits = wait_until(lambda: httpx.get(f"{url}/reef/scenarios/refused/commits").json()["commits"],
                             timeout=60)
        assert len(commits) == 1 and commits[0]["release_id"] is None
        assert "harness surface refused the candidate" in commits[0]["decision"]["reason"]
        releases = httpx.get(f"{url}/reef/scenarios/refused/releases").json()["releases"]
        assert not any(r["operation"] == "training" for r in releases)
