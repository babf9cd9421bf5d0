"""The gate asks the skill surface about the candidate as a successor: a pool may not lose a skill."""

from __future__ import annotations

import httpx

from reef_core.grow.trainer import CandidateUpdate, Trainer
from reef_core.surfaces.harness import encode_tree
from reef_core.surfaces.skills import Skill, pool_files
from reef_core.testing.fixtures import wait_until

A = Skill(slug="alpha", category="c", body="Alpha body.", description="Alpha. NOT for: beta work.")
B = Skill(slug="beta", category="c", body="Beta body.", description="Beta. NOT for: alpha work.")


class ShrinkingTrainer(Trainer):
    """Seeds a two-skill pool, then proposes a pool without ``beta`` (valid on its own)."""

    artifact_kind = "harness"

    def initial_files(self):
        return encode_tree(pool_files([A, B]))

    def train(self, batch, ctx):
        return CandidateUpdate(files=encode_tree(pool_files([A])))


def test_candidate_dropping_a_skill_is_rejected_and_the_pool_still_serves(serve_trainer):
    with serve_trainer("shrinking", ShrinkingTrainer, "recipe.processor=per_report", "recipe.surface=skills",
                       "+recipe.processor_options.batch_size=1") as url:
        headers = {"x-reef-scenario": "pool"}
        chat = httpx.post(f"{url}/v1/chat/completions", headers=headers,
                          json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        receipt = chat.headers["x-reef-agent-record-id"]
        assert httpx.post(f"{url}/reef/report", headers=headers,
                          json={"score": 1, "references": [receipt]}).status_code == 200

        def night():
            rows = httpx.get(f"{url}/reef/scenarios/pool/commits").json()["commits"]
            return [row for row in rows if row.get("operation") != "creation"]

        rows = wait_until(night, timeout=60, what="the trainer's step")
        assert rows[0]["release_id"] is None
        assert "may not remove skills; missing: beta" in rows[0]["decision"]["reason"]
        served = httpx.get(f"{url}/reef/skills", headers=headers).json()
        assert [s["slug"] for s in served["skills"]] == ["alpha", "beta"]
