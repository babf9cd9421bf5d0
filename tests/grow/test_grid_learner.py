"""The grid barrier inside a learner: one trainer call per complete step, constant groups consumed, no retraining
after a restart."""

from __future__ import annotations

import httpx
import pytest

from reef_core.grow.trainer import Trainer
from reef_core.testing.fixtures import wait_until

SCENARIO = "grid-learner"
HEADERS = {"x-reef-scenario": SCENARIO}


class RecordingTrainer(Trainer):
    batches: list = []

    def train(self, batch, ctx):
        RecordingTrainer.batches.append(batch)
        return None  # skipped: the batch is still consumed, with a commit-log row


@pytest.fixture
def serve(serve_trainer):
    return lambda: serve_trainer("recording", RecordingTrainer, "recipe.processor=grid",
                                 "+recipe.processor_options.groups=2", "+recipe.processor_options.rollouts_per_group=2")


def _status(url):
    return httpx.get(f"{url}/reef/scenarios/{SCENARIO}/status").json()


def test_learner_trains_a_step_once_when_complete_and_never_again_after_a_restart(serve):
    RecordingTrainer.batches = []
    scores = {(0, 0): 1.0, (0, 1): 1.0, (1, 0): 0.0, (1, 1): 0.5}  # group 0 is constant
    with serve() as url:
        receipts = {}
        for (g, r), score in scores.items():
            chat = httpx.post(f"{url}/v1/chat/completions", headers=HEADERS,
                              json={"model": "m", "messages": [{"role": "user", "content": f"g{g} r{r}"}]})
            receipts[(g, r)] = chat.headers["x-reef-agent-record-id"]
        reports = []
        for (g, r), score in list(scores.items())[:3]:
            body = {"score": score, "references": [receipts[(g, r)]],
                    "metadata": {"step": 0, "group": g, "rollout": r}}
            response = httpx.post(f"{url}/reef/report", headers=HEADERS, json=body)
            assert response.status_code == 200, response.text
            reports.append(response.json()["agent_record_id"])
        wait_until(lambda: (s := _status(url))["records_seen"] == 7 and s["learner"] == "idle", timeout=30)
        assert RecordingTrainer.batches == []  # one slot missing: nothing trains

        body = {"score": scores[(1, 1)], "references": [receipts[(1, 1)]],
                "metadata": {"step": 0, "group": 1, "rollout": 1}}
        reports.append(httpx.post(f"{url}/reef/report", headers=HEADERS, json=body).json()["agent_record_id"])
        commits = wait_until(lambda: httpx.get(f"{url}/reef/scenarios/{SCENARIO}/commits").json()["commits"],
                             timeout=30)
        assert len(RecordingTrainer.batches) == 1
        batch = RecordingTrainer.batches[0]
        assert [(s.metadata["reef"]["grid"]["group"], s.reward) for s in batch.samples] == [(1, 0.0), (1, 0.5)]
        # The constant group's records are consumed with the step.
        assert set(commits[0]["consumed_ids"]) == set(receipts.values()) | set(reports)
        assert _status(url)["processor"]["dropped"] == {"constant_group": 2, "trainer_skipped": 2}

    with serve() as url:
        status = wait_until(lambda: (s := _status(url))["records_seen"] == 8 and s["learner"] == "idle" and s,
                            timeout=30)
        assert status["processor"]["replayed_consumed"] == 4 and status["processor"]["pending_units"] == 0
        assert len(RecordingTrainer.batches) == 1
