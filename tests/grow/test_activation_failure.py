"""A committed release that fails to activate: the head returns to what still serves (a ``restore`` release),
serving continues on the previous version, and status shows the error, also after a restart."""

from __future__ import annotations

import httpx

from reef_core import hookimpl
from reef_core.commit.commitlog import CommitLog
from reef_core.commit.committer import Committer
from reef_core.commit.git_store import GitArtifactStore
from reef_core.grow.trainer import CandidateUpdate, Trainer
from reef_core.surfaces.harness import HarnessSurface
from reef_core.testing.fixtures import wait_until

POISON = "poison.md"


class FlakyHarness(HarnessSurface):
    """A harness surface whose activation fails for a tree holding ``poison.md`` (an engine error after the
    release validated and was committed); like every surface it leaves what served in place when it raises."""

    def activate(self, scenario, release_id, payload=None, files=None):
        tree = payload if payload is not None else files() if files is not None else {}
        if POISON in tree:
            raise RuntimeError("injected activation failure")
        super().activate(scenario, release_id, payload=payload, files=files)


class FlakyHarnessPlugin:
    @staticmethod
    @hookimpl
    def reef_register_surfaces(register):
        register("flaky_harness", lambda *, ports=None, options=None: FlakyHarness(ports.artifacts, options))


class CountingTrainer(Trainer):
    """Numbers its own training calls: commit-log steps also count the scenario's creation release."""

    calls = 0

    def nth_call(self) -> int:
        self.calls += 1
        return self.calls


class TwoTreeTrainer(CountingTrainer):
    """Step 1 proposes a good tree, every later step one the surface fails to activate."""

    artifact_kind = "harness"

    def train(self, batch, ctx):
        if self.nth_call() == 1:
            return CandidateUpdate(files={"system_prompt.md": b"good"})
        return CandidateUpdate(files={"system_prompt.md": b"bad", POISON: b"x"})


class WeightsTrainer(CountingTrainer):
    """Step 1 proposes weights that load (an empty partial state dict), step 2 a weight file that does not load,
    step 3 a release without weights (refused by the surface's validation, before anything is committed)."""

    def train(self, batch, ctx):
        from safetensors.torch import save

        step = self.nth_call()
        if step == 1:
            return CandidateUpdate(files={"model.safetensors": save({})})
        if step == 2:
            return CandidateUpdate(files={"model.safetensors": b"this is not a safetensors file"})
        return CandidateUpdate(files={"notes.txt": b"no weights here"})


class LiveWeightsTrainer(CountingTrainer):
    """Versions between checkpoints activate from memory: step 2's state dict names a tensor the model lacks."""

    def train(self, batch, ctx):
        import torch
        from safetensors.torch import save

        state = {} if self.nth_call() == 1 else {"no.such.weight": torch.zeros(1)}
        return CandidateUpdate(files={"model.safetensors": save(state)}, payload=state)


def _chat(url: str, scenario: str) -> httpx.Response:
    response = httpx.post(f"{url}/v1/chat/completions", headers={"x-reef-scenario": scenario}, timeout=60,
                          json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200, response.text
    return response


def _train_one_step(url: str, scenario: str, rows: int) -> list[dict]:
    receipt = _chat(url, scenario).headers["x-reef-agent-record-id"]
    report = httpx.post(f"{url}/reef/report", headers={"x-reef-scenario": scenario},
                        json={"score": 1, "references": [receipt]})
    assert report.status_code == 200, report.text
    commits = wait_until(lambda: (lambda c: c if len(c) >= rows else None)(_commits(url, scenario)), timeout=120)
    # A commit-log row is the commit point; activation (or the restore after a failed one) follows it: wait
    # until the learner has finished its turn, so head, status and serving have settled.
    wait_until(lambda: _status(url, scenario).get("learner") == "idle", timeout=120)
    return commits


def _commits(url: str, scenario: str) -> list[dict]:
    """The commit log after the scenario's creation (release 0, when the recipe makes one)."""
    rows = httpx.get(f"{url}/reef/scenarios/{scenario}/commits").json()["commits"]
    return [row for row in rows if row["operation"] != "creation"]


def _releases(url: str, scenario: str) -> list[dict]:
    return httpx.get(f"{url}/reef/scenarios/{scenario}/releases").json()["releases"]


def _status(url: str, scenario: str) -> dict:
    return httpx.get(f"{url}/reef/scenarios/{scenario}/status").json()


def _assert_restored(url: str, scenario: str, good: dict, failed_id: str) -> dict:
    """The head is a restore release of the release that served before ``failed_id`` (``good``'s content), naming
    the failure; status agrees."""
    rows = _releases(url, scenario)
    head = next(r for r in rows if r["current"])
    assert head["operation"] == "restore" and head["content_id"] == good["content_id"]
    assert head["parent_release_id"] == failed_id
    failed = next(r for r in rows if r["release_id"] == failed_id)  # history is appended, never rewritten
    assert head["source"]["release_id"] == failed["parent_release_id"] and head["source"]["failed_release_id"] == failed_id
    assert head["source"]["error"]
    status = _status(url, scenario)
    assert status["current_release_id"] == head["release_id"]
    assert status["activation_error"]["release_id"] == failed_id
    assert status["activation_error"]["serving_release_id"] == head["release_id"]
    return head


def test_harness_activation_failure_restores_previous_release(serve_trainer, tmp_path):
    def server():
        return serve_trainer("two_trees", TwoTreeTrainer, "recipe.processor=per_report",
                             "recipe.surface=flaky_harness", "+recipe.processor_options.batch_size=1",
                             plugins=(FlakyHarnessPlugin,))

    with server() as url:
        commits = _train_one_step(url, "flaky", 1)
        good_id = commits[0]["release_id"]
        good = next(r for r in _releases(url, "flaky") if r["release_id"] == good_id)
        assert _chat(url, "flaky").headers["x-reef-release-id"] == good_id

        commits = _train_one_step(url, "flaky", 3)
        assert [c["operation"] for c in commits] == ["training", "training", "restore"]
        failed_id = commits[1]["release_id"]
        assert commits[2]["failed_release_id"] == failed_id and commits[2]["target_release_id"] == good_id
        assert "injected activation failure" in commits[2]["error"]
        head = _assert_restored(url, "flaky", good, failed_id)
        status = _status(url, "flaky")
        assert status["counters"]["activation_failures"] == 1 and "injected" in status["activation_error"]["error"]
        # Serving continues on the previous content, under the release the head names.
        assert _chat(url, "flaky").headers["x-reef-release-id"] == head["release_id"]
        assert httpx.get(f"{url}/reef/harness", headers={"x-reef-scenario": "flaky"}).json()["files"] == \
            {"system_prompt.md": "good"}

        # Rolling back to the release that cannot be activated follows the same rule: 409, head restored again.
        rolled = httpx.post(f"{url}/reef/scenarios/flaky/rollback", json={"release_id": failed_id})
        assert rolled.status_code == 409 and "failed to activate" in rolled.text
        head = _assert_restored(url, "flaky", good, next(
            r for r in _releases(url, "flaky") if r["operation"] == "rollback")["release_id"])
        assert _chat(url, "flaky").headers["x-reef-release-id"] == head["release_id"]

    with server() as url:  # a restart: head, status and serving still agree
        rows = _releases(url, "flaky")
        assert next(r for r in rows if r["current"])["release_id"] == head["release_id"]
        status = _status(url, "flaky")
        assert status["current_release_id"] == head["release_id"]
        assert status["activation_error"]["restored_release_id"] == head["release_id"]
        assert _chat(url, "flaky").headers["x-reef-release-id"] == head["release_id"]

    # A crash between a commit and its restore leaves a head that does not activate: start-up restores its parent.
    store = GitArtifactStore(tmp_path / "artifacts.git", tmp_path / "artifacts-work")
    with CommitLog.for_scenario(tmp_path / "commits", "flaky") as commit_log:
        crashed, _ = Committer(store, commit_log, "flaky").publish(
            {"system_prompt.md": b"bad", POISON: b"x"}, expected_head=head["release_id"])
    with server() as url:
        restored = _assert_restored(url, "flaky", good, crashed.release_id)
        assert restored["source"]["release_id"] == head["release_id"]
        assert _chat(url, "flaky").headers["x-reef-release-id"] == restored["release_id"]


def test_weights_activation_failure_keeps_previous_weights(serve_trainer):
    def server():
        return serve_trainer("two_weights", WeightsTrainer, "engine.kind=local", "engine.model=tiny",
                             "engine.max_new_tokens=4", "engine.seed=0", "recipe.processor=per_report",
                             "recipe.surface=weights", "+recipe.processor_options.batch_size=1")

    with server() as url:
        commits = _train_one_step(url, "w", 1)
        good_id = commits[0]["release_id"]
        good = next(r for r in _releases(url, "w") if r["release_id"] == good_id)
        commits = _train_one_step(url, "w", 3)
        assert [c["operation"] for c in commits] == ["training", "training", "restore"]
        failed_id = commits[1]["release_id"]
        head = _assert_restored(url, "w", good, failed_id)
        status = _status(url, "w")
        # The version that serves is the restored release's, and the next record is served by it.
        receipt = _chat(url, "w").headers["x-reef-agent-record-id"]
        record = httpx.get(f"{url}/reef/scenarios/w/records/{receipt}").json()
        assert record["artifact_ref"] == status["current_version"]
        release_version = head["metrics"]["serving_version"]
        assert release_version == status["current_version"]
        # A candidate without weights never becomes a release: the surface validates before the commit.
        commits = _train_one_step(url, "w", 4)
        assert commits[3]["release_id"] is None and "weights surface refused" in commits[3]["decision"]["reason"]
        assert next(r for r in _releases(url, "w") if r["current"])["release_id"] == head["release_id"]

    with server() as url:
        status = _status(url, "w")
        assert status["current_release_id"] == head["release_id"]
        assert status["activation_error"]["release_id"] == failed_id
        receipt = _chat(url, "w").headers["x-reef-agent-record-id"]
        record = httpx.get(f"{url}/reef/scenarios/w/records/{receipt}").json()
        assert record["artifact_ref"] == status["current_version"]


def test_live_weights_activation_failure_keeps_previous_live_version(serve_trainer):
    with serve_trainer("live_weights", LiveWeightsTrainer, "engine.kind=local", "engine.model=tiny",
                       "engine.max_new_tokens=4", "engine.seed=0", "recipe.processor=per_report",
                       "recipe.surface=weights", "trainer.checkpoint_every_n_versions=3",
                       "+recipe.processor_options.batch_size=1") as url:
        _train_one_step(url, "lw", 1)
        serving = _status(url, "lw")
        assert serving["current_release_id"] == "live:lw:2"
        commits = _train_one_step(url, "lw", 3)
        assert [c["operation"] for c in commits] == ["training", "training", "restore"]
        assert commits[2]["failed_release_id"] == "live:lw:3" and commits[2]["target_release_id"] == "live:lw:2"
        assert "keys the model lacks" in commits[2]["error"]
        status = _status(url, "lw")
        assert status["current_release_id"] == "live:lw:2" and status["current_version"] == serving["current_version"]
        assert status["activation_error"]["release_id"] == "live:lw:3"
        assert status["versions_since_checkpoint"] == 1
        receipt = _chat(url, "lw").headers["x-reef-agent-record-id"]
        assert httpx.get(f"{url}/reef/scenarios/lw/records/{receipt}").json()["artifact_ref"] == \
            serving["current_version"]
