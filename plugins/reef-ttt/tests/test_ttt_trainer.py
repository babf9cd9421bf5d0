"""The TTT trainer around its policy step: the archive sees every rollout, the gradient only varied groups, a claim
is re-verified, malformed guidance scores 0, and the archive commits only with an accepted candidate."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from reef_core.api import Batch, CandidateUpdate, ConfigError, Sample
from reef_ttt.options import TTTOptions, check_processor_options
from reef_ttt.trainer import ARCHIVE_FILE, TTTTrainer
from reef_ttt.tasks.vowels import Vowels


class FakeInner:
    """Stands for the TorchTrainer: records what it was asked to train."""

    def __init__(self):
        self.batches, self.accepted_ids, self.rejections = [], [], 0

    def train(self, batch, ctx):
        self.batches.append(batch)
        return CandidateUpdate(files={"adapter/adapter_model.safetensors": b"w"}, metrics={},
                               algorithm_state={"steps": len(self.batches)})

    def accepted(self, update, release_id):
        self.accepted_ids.append(release_id)

    def rejected(self, update):
        self.rejections += 1


def _sample(step, group, rollout, reward, state, text="ok"):
    grid = {"step": step, "group": group, "rollout": rollout, "groups": 2, "rollouts_per_group": 3}
    return Sample(scenario="s", messages=[{"role": "user", "content": "p"}, {"role": "assistant", "content": text}],
                  segments=[SimpleNamespace(message_index=1)], reward=reward, group_key=f"{step}:{group}",
                  metadata={"state": state, "reef": {"grid": grid}})


def _trainer(**options):
    opts = TTTOptions.from_options({"task": "reef_ttt.tasks.vowels:make_task", "groups_per_step": 2,
                                    "rollouts_per_group": 3, **options})
    return TTTTrainer(FakeInner(), Vowels(), opts)


def _ctx(release="r0", files=None):
    return SimpleNamespace(serving_release_id=release, current_files=lambda: files or {}, step=1,
                           serving_version="i:0", algorithm_state=None, scenario="s")


def test_archive_sees_every_rollout_and_the_gradient_only_varied_groups():
    trainer = _trainer()
    samples = [_sample(0, 0, r, 1.0, "aaa") for r in range(3)]  # a constant group: all perfect
    samples += [_sample(0, 1, r, v, s) for r, (v, s) in enumerate([(0.0, "xyz"), (0.5, "ax"), (0.99, "ba")])]
    update = trainer.train(Batch("b", samples, [], "s"), _ctx())
    trained = trainer.inner.batches[0].samples
    assert [s.group_key for s in trained] == ["0:1"] * 3
    archive = json.loads(update.files[ARCHIVE_FILE])
    states = {e["state"] for e in archive["entries"]}
    assert "aaa" in states  # the constant group's state reached the archive
    assert archive["best"]["score"] == 1.0 and archive["best"]["state"] == "aaa"
    assert update.metrics["ttt/constant_groups"] == 1 and update.metrics["ttt/score_mismatches"] == 1  # "ba": 0.5
    assert update.algorithm_state["ttt"] == {"step": 0, "best": 1.0, "size": len(archive["entries"])}
    assert set(update.files) == {"adapter/adapter_model.safetensors", ARCHIVE_FILE}


def test_claims_are_re_verified_and_the_archive_commits_only_when_accepted():
    trainer = _trainer()
    liar = [_sample(0, g, r, 1.0 if r == 0 else 0.0, "zzz") for g in range(2) for r in range(3)]
    update = trainer.train(Batch("b", liar, [], "s"), _ctx())
    assert json.loads(update.files[ARCHIVE_FILE])["best"]["score"] == 0.0  # "zzz" verifies to 0, not 1
    trainer.rejected(update)
    assert trainer.archive_of("r0", lambda: {}).history == []  # nothing committed
    good = [_sample(0, g, r, 1.0 if r == 0 else 0.0, "aa" if r == 0 else "zz") for g in range(2) for r in range(3)]
    update = trainer.train(Batch("b2", good, [], "s"), _ctx())
    trainer.accepted(update, "r1")
    assert trainer.archive_of("r1", lambda: {}).history == [1.0]
    # another release (a restart, a rollback) is read from its own files
    files = {ARCHIVE_FILE: update.files[ARCHIVE_FILE]}
    fresh = _trainer()
    assert fresh.archive_of("r1", lambda: files).summary() == trainer.archive_of("r1", lambda: {}).summary()
    assert fresh.archive_of("r0", lambda: {}).history == []  # a release without one: the seeds


def test_malformed_guidance_scores_zero_and_never_enters_the_archive():
    trainer = _trainer(mode="guidance")
    samples = [_sample(0, 0, 0, 0.9, "aaa", text="no tags"), _sample(0, 0, 1, 0.5, "ab", text="<guidance>x</guidance>"),
               _sample(0, 0, 2, 0.1, "abcd", text="<guidance>a</guidance><guidance>b</guidance>")]
    samples += [_sample(0, 1, r, 0.2 * r, "b" * (r + 1), text="<guidance>g</guidance>") for r in range(3)]
    update = trainer.train(Batch("b", samples, [], "s"), _ctx())
    trained = trainer.inner.batches[0].samples
    assert [s.reward for s in trained[:3]] == [0.0, 0.5, 0.0]
    assert update.metrics["ttt/malformed_guidance"] == 2 and update.metrics["ttt/failed_rollouts"] == 2
    states = {e["state"] for e in json.loads(update.files[ARCHIVE_FILE])["entries"]}
    assert "aaa" not in states and "abcd" not in states and "ab" in states


@pytest.mark.parametrize("options, message", [
    ({"rollouts_per_group": 2}, "rollouts_per_group"),
    ({"mode": "other"}, "mode"),
    ({"advantage": "ppo"}, "advantage"),
    ({"kl_coef": -1}, "kl_coef"),
    ({"bogus": 1}, "unknown option"),
    ({"task": "no_colon"}, "task"),
    ({"learn": "no"}, "learn must be true or false"),
    ({"learn": False, "weight_decay": 0.1}, "needs weight_decay 0"),
])
def test_options_are_checked_naming_the_key(options, message):
    with pytest.raises(ConfigError) as info:
        TTTOptions.from_options(options)
    assert message in info.value.message


def test_processor_must_be_the_sequential_grid_of_the_same_shape():
    opts = TTTOptions.from_options({"groups_per_step": 2, "rollouts_per_group": 4})
    good = {"groups": 2, "rollouts_per_group": 4, "drop_constant_groups": False, "sequential": True}
    check_processor_options(opts, "grid", good)
    for bad in ({**good, "groups": 3}, {**good, "sequential": False}, {**good, "drop_constant_groups": True},
                {**good, "max_staleness": 2}):
        with pytest.raises(ConfigError):
            check_processor_options(opts, "grid", bad)
    with pytest.raises(ConfigError):
        check_processor_options(opts, "per_report", good)
