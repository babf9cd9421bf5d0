"""A trainer that keeps failing cannot stall its scenario: the batch is dropped after a few attempts."""

from __future__ import annotations

import logging

import httpx

from reef_core.grow.trainer import Trainer
from reef_core.testing.fixtures import wait_until


def _train_on_one_report(url: str, scenario: str) -> tuple[str, list[dict]]:
    """One chat and a report quoting its receipt (batch_size=1: a batch); the receipt and the commit log once the
    learner has written to it."""
    headers = {"x-reef-scenario": scenario}
    chat = httpx.post(f"{url}/v1/chat/completions", headers=headers,
                      json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    receipt = chat.headers["x-reef-agent-record-id"]
    report = httpx.post(f"{url}/reef/report", headers=headers, json={"score": 1, "references": [receipt]})
    assert report.status_code == 200, report.text
    commits = wait_until(lambda: httpx.get(f"{url}/reef/scenarios/{scenario}/commits").json()["commits"], timeout=60)
    return receipt, commits


class ExplodingTrainer(Trainer):
    calls = 0

    def train(self, batch, ctx):
        ExplodingTrainer.calls += 1
        raise RuntimeError("the trainer broke")


def test_failing_batch_is_dropped_after_retries(serve_trainer):
    with serve_trainer("exploding", ExplodingTrainer, "recipe.processor=per_report",
                       "+recipe.processor_options.batch_size=1") as url:
        receipt, commits = _train_on_one_report(url, "broken")
        assert len(commits) == 1 and "the trainer broke" in commits[0]["metrics"]["train_error"]
        assert set(commits[0]["consumed_ids"]) >= {receipt}
        status = httpx.get(f"{url}/reef/scenarios/broken/status").json()
        assert status["processor"]["dropped"] == status["dropped"] == {"trainer_failed": 1}
        assert ExplodingTrainer.calls == 3 and status["counters"]["errors"] == 3
        # Serving was never affected.
        assert httpx.post(f"{url}/v1/chat/completions", headers={"x-reef-scenario": "broken"},
                          json={"model": "m", "messages": [{"role": "user", "content": "still"}]}).status_code == 200


class BadTreeTrainer(Trainer):
    """Proposes a harness tree the harness surface cannot serve (a path escaping the tree)."""

    artifact_kind = "harness"

    def train(self, batch, ctx):
        from reef_core.grow.trainer import CandidateUpdate

        return CandidateUpdate(files={"../outside.md": b"escape"})


def test_candidate_its_surface_refuses_is_rejected_not_published(serve_trainer):
    """Surface.validate is the last check before a release is written: a refused candidate is a
    rejection in the commit log, and no release exists."""
    with serve_trainer("bad_tree", BadTreeTrainer, "recipe.processor=per_report", "recipe.surface=harness",
                       "+recipe.processor_options.batch_size=1") as url:
        receipt, commits = _train_on_one_report(url, "refused")
        assert len(commits) == 1 and commits[0]["release_id"] is None
        assert "harness surface refused the candidate" in commits[0]["decision"]["reason"]
        releases = httpx.get(f"{url}/reef/scenarios/refused/releases").json()["releases"]
        assert not any(r["operation"] == "training" for r in releases)


class RefusingTrainer(Trainer):
    """Refuses every batch the way a trainer with a bad option does (a ReefError): the step is skipped."""

    def train(self, batch, ctx):
        from reef_core.errors import ConfigError

        raise ConfigError("sao: unknown option 'eps_clp' in recipe.options")


def test_a_refused_step_counts_as_an_error_and_is_logged(serve_trainer, caplog):
    # #37: the batch was committed as skipped while status said errors: 0, last_error: None, and nothing was logged.
    caplog.set_level(logging.WARNING, logger="reef.learner")
    with serve_trainer("refusing", RefusingTrainer, "recipe.processor=per_report",
                       "+recipe.processor_options.batch_size=1") as url:
        receipt, commits = _train_on_one_report(url, "refusing")
        assert len(commits) == 1 and "eps_clp" in commits[0]["metrics"]["train_error"]
        status = httpx.get(f"{url}/reef/scenarios/refusing/status").json()
        assert status["counters"]["skipped"] == 1 and status["counters"]["errors"] == 1, status["counters"]
        assert "eps_clp" in status["last_error"]
        assert status["dropped"] == {"trainer_refused": 1}  # the label; the message is in last_error
        page = httpx.get(f"{url}/ui/scenarios/refusing").text  # and the dashboard shows it
        assert "1 failed or skipped steps" in page and "eps_clp" in page and "<td>trainer_refused</td>" in page
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "eps_clp" in r.getMessage()]
    assert len(warned) == 1 and "refusing" in warned[0].getMessage()
