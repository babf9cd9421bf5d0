"""trainer.backend=slime against the FAKE slime driver: the job marker recovers from a crash in every phase.

The commit log stand-in below plays the learner's part (commit a step's candidate and its consumed records in one
go, then tell the trainer). A crash on Reef's side is a ``crash_point`` that raises (what is on disk is what a
killed process leaves: every marker write is atomic); a crash of the job is a real subprocess exiting 137.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors

from reef_core.config import compose_config
from reef_core.config.schema import SlimeConfig
from reef_core.errors import ConfigError
from reef_core.models.loading import build_tiny_model
from reef_core.grow.slime import marker as m
from reef_core.grow.slime import trainer as slime_trainer
from reef_core.grow.slime.trainer import SlimeJobFailed, SlimeTrainer
from reef_core.grow.trainer import TrainContext
from reef_core.observe.processor import Batch, Sample, Segment
from reef_core.surfaces.weights import MODEL_FILE
from reef_core.testing import fake_slime

#: Tiny models run fastest single-threaded (intra-op threads mostly wait on each other).
pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAUNCH = [sys.executable, "-m", "reef_core.testing.fake_slime"]


class Crash(BaseException):
    """Stands for the Reef process dying at a crash point."""


def _batch(n: int, first: int = 0) -> Batch:
    samples, ids = [], []
    for i in range(first, first + n):
        tokens = {"prompt_ids": [5, 6, 7 + i % 5], "output_ids": [40 + i, 41, 42], "output_logprobs": [-2.0] * 3,
                  "version": None}
        seg = Segment(message_index=1, record_id=f"r{i}", version=None, tokens=tokens)
        samples.append(Sample(scenario="s", messages=[{"role": "user", "content": "q"},
                                                      {"role": "assistant", "content": "a"}],
                              segments=[seg], reward=1.0 if i % 2 else -0.5, report_id=f"rep{i}",
                              source_ids=[f"r{i}", f"rep{i}"]))
        ids += [f"r{i}", f"rep{i}"]
    return Batch(batch_id=f"b{first}", samples=samples, record_ids=ids, scenario="s")


@dataclass
class CommitLog:
    """The learner's side: steps committed with their consumed ids and the head release's files."""

    rows: list[dict] = field(default_factory=list)
    head_files: dict = field(default_factory=dict)

    def ctx(self) -> TrainContext:
        head = self.rows[-1]["release_id"] if self.rows else None
        return TrainContext(scenario="s", step=len(self.rows) + 1, serving_release_id=head, serving_version=None,
                            algorithm_state=None, current_files=lambda: dict(self.head_files))

    def commit(self, update, batch) -> str:
        release_id = f"rel-{len(self.rows) + 1}"
        self.rows.append({"step": len(self.rows) + 1, "release_id": release_id, "consumed": list(batch.record_ids)})
        self.head_files = dict(update.files)
        return release_id

    def consumed(self) -> list[str]:
        return [rid for row in self.rows for rid in row["consumed"]]


def _trainer(tok, jobs_dir: Path, *, in_process: bool = True) -> SlimeTrainer:
    t = SlimeTrainer(fake_slime.ReinforceObjective(), launch=LAUNCH, flags={"--seed": 3}, jobs_dir=jobs_dir,
                     timeout_s=120, lr=1e-2, load_base_model=lambda: build_tiny_model(seed=0, tokenizer=tok))
    if in_process:  # the same job without the interpreter start-up (the crash under test is Reef's)
        t.run_driver = fake_slime.run_job
    return t


def _step(trainer: SlimeTrainer, log: CommitLog, batch: Batch, *, crash_after_commit: bool = False) -> str:
    update = trainer.train(batch, log.ctx())
    release_id = log.commit(update, batch)
    if crash_after_commit:
        raise Crash("after the commit, before the trainer heard of it")
    trainer.accepted(update, release_id)
    return release_id


def _crash_at(monkeypatch, name: str) -> None:
    def point(at):
        if at == name:
            raise Crash(at)

    monkeypatch.setattr(slime_trainer, "crash_point", point)


def _jobs(jobs_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(jobs_dir.rglob(m.MARKER))]


def _weights(files) -> dict:
    return load_safetensors(bytes(files[MODEL_FILE]))


@pytest.fixture(scope="module")
def reference(tok, tmp_path_factory):
    """Head weights after steps [0..2) and [2..4), trained without any crash."""
    log = CommitLog()
    t = _trainer(tok, tmp_path_factory.mktemp("ref"))
    _step(t, log, _batch(2, 0))
    first = _weights(log.head_files)
    _step(t, log, _batch(2, 2))
    return first, _weights(log.head_files)


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def _finish_and_check(tok, jobs_dir, log, reference, *, launches: int) -> None:
    """A restarted trainer completes step 1 (launching ``launches`` jobs) and step 2; the head equals the crash-free
    run's and every record was consumed exactly once."""
    again = _trainer(tok, jobs_dir)
    if len(log.rows) == 0:
        _step(again, log, _batch(2, 0))
    assert again.launched == launches
    _assert_same(_weights(log.head_files), reference[0])
    _step(again, log, _batch(2, 2))
    _assert_same(_weights(log.head_files), reference[1])
    consumed = log.consumed()
    assert len(consumed) == len(set(consumed)) == 8
    phases = [j["phase"] for j in _jobs(jobs_dir)]
    assert all(p in m.FINAL for p in phases), phases
    assert sum(p == m.COMPLETE for p in phases) == 2


def test_a_normal_step_runs_the_job_through_every_phase(tok, tmp_path, reference):
    log = CommitLog()
    t = _trainer(tok, tmp_path, in_process=False)  # the real command: a subprocess reading the job directory
    release = _step(t, log, _batch(2, 0))
    (job,) = _jobs(tmp_path)
    assert job["history"] == [m.RUNNING, m.CHECKPOINT, m.UPDATING_WEIGHTS, m.READY_TO_COMMIT, m.HEAD_COMMITTED,
                               m.COMPLETE]
    assert job["release_id"] == release and job["record_ids"] == sorted(_batch(2, 0).record_ids)
    job_dir = next(tmp_path.rglob(m.MARKER)).parent
    args = json.loads((job_dir / "job.json").read_text())["slime_args"]
    assert args[args.index("--loss-type") + 1] == "policy_loss" and "--debug-train-only" in args
    assert not (job_dir / "checkpoint").exists() and not (job_dir / "rollout.pt").exists()  # cleaned up
    assert not (job_dir / "megatron").exists()  # slime's Megatron save (--save) goes with the job's inputs
    _assert_same(_weights(log.head_files), reference[0])
    assert any((_weights(log.head_files)[k] != v).any() for k, v in build_tiny_model(seed=0, tokenizer=tok)[0]
               .state_dict().items() if k in _weights(log.head_files))  # the step moved the weights


def test_job_killed_while_running_is_abandoned_and_the_batch_trains_once(tok, tmp_path, reference, monkeypatch):
    log = CommitLog()
    monkeypatch.setenv(fake_slime.CRASH_ENV, m.RUNNING)
    with pytest.raises(SlimeJobFailed):
        _step(_trainer(tok, tmp_path, in_process=False), log, _batch(2, 0))
    monkeypatch.delenv(fake_slime.CRASH_ENV)
    assert [j["phase"] for j in _jobs(tmp_path)] == [m.RUNNING] and not log.rows
    _finish_and_check(tok, tmp_path, log, reference, launches=1)
    assert len(list(tmp_path.rglob("*.abandoned"))) == 1


def test_job_killed_after_its_checkpoint_is_adopted_without_training_again(tok, tmp_path, reference, monkeypatch):
    log = CommitLog()
    # The job dies right after CHECKPOINT (in-process: it writes nothing after its marker, so the disk is what
    # os._exit leaves), and Reef dies before reading the checkpoint.
    monkeypatch.setenv(fake_slime.CRASH_ENV, m.CHECKPOINT)
    monkeypatch.setattr(fake_slime.os, "_exit", lambda status: (_ for _ in ()).throw(Crash(status)))
    with pytest.raises(Crash):
        _step(_trainer(tok, tmp_path), log, _batch(2, 0))
    monkeypatch.undo()
    assert [j["phase"] for j in _jobs(tmp_path)] == [m.CHECKPOINT]
    _finish_and_check(tok, tmp_path, log, reference, launches=0)


@pytest.mark.parametrize("point", ["slime_updating_weights", "slime_ready_to_commit"])
def test_reef_crash_before_the_commit_adopts_the_checkpoint(tok, tmp_path, reference, monkeypatch, point):
    log = CommitLog()
    _crash_at(monkeypatch, point)
    with pytest.raises(Crash):
        _step(_trainer(tok, tmp_path), log, _batch(2, 0))
    monkeypatch.undo()
    assert not log.rows
    _finish_and_check(tok, tmp_path, log, reference, launches=0)


def test_reef_crash_after_the_commit_settles_the_job_from_the_log(tok, tmp_path, reference):
    log = CommitLog()
    with pytest.raises(Crash):
        _step(_trainer(tok, tmp_path), log, _batch(2, 0), crash_after_commit=True)
    assert [j["phase"] for j in _jobs(tmp_path)] == [m.READY_TO_COMMIT] and len(log.rows) == 1
    _finish_and_check(tok, tmp_path, log, reference, launches=0)
    first = _jobs(tmp_path)[0]
    assert first["history"][-2:] == [m.HEAD_COMMITTED, m.COMPLETE] and first["release_id"] == "rel-1"


def test_reef_crash_after_head_committed_only_cleans_up(tok, tmp_path, reference, monkeypatch):
    log = CommitLog()
    _crash_at(monkeypatch, "slime_head_committed")
    with pytest.raises(Crash):
        _step(_trainer(tok, tmp_path), log, _batch(2, 0))
    monkeypatch.undo()
    assert [j["phase"] for j in _jobs(tmp_path)] == [m.HEAD_COMMITTED]
    _finish_and_check(tok, tmp_path, log, reference, launches=0)


def test_a_checkpoint_of_another_batch_is_not_adopted(tok, tmp_path, reference, monkeypatch):
    log = CommitLog()
    _crash_at(monkeypatch, "slime_ready_to_commit")
    with pytest.raises(Crash):
        _step(_trainer(tok, tmp_path), log, _batch(2, 4))  # records 4..5, then the pending batch becomes 0..1
    monkeypatch.undo()
    _finish_and_check(tok, tmp_path, log, reference, launches=1)
    assert any(j["phase"] == m.ABANDONED for j in _jobs(tmp_path))


# --------------------------------------------------------------------------- configuration


def test_unknown_and_reef_owned_flags_are_refused_at_config_load():
    with pytest.raises(ConfigError, match="unknown flag --bogus-flag"):
        compose_config(["trainer.backend=slime", "+trainer.slime.flags={--bogus-flag: 1}"])
    with pytest.raises(ConfigError, match="--loss-type is set by Reef"):
        SlimeConfig(flags={"--loss-type": "sft_loss"})
    with pytest.raises(ConfigError, match="launch_cmd"):
        compose_config(["trainer.backend=slime", "trainer.slime.launch_cmd=x"])
    cfg = compose_config(["trainer.backend=slime", "+trainer.slime.flags={--global-batch-size: 8}"])
    assert cfg.trainer.slime.flags == {"--global-batch-size": 8}


def test_an_objective_without_a_loss_family_is_refused(tok, tmp_path):
    from reef_core.config.schema import TrainerConfig
    from reef_core.grow.torch_backend import TorchTrainer
    from reef_core.grow.trainer import TrainerSetup

    class Other(fake_slime.ReinforceObjective):
        name = "mystery"
        slime_loss = None

    section = TrainerConfig(backend="slime", slime=SlimeConfig(launch=LAUNCH))
    setup = TrainerSetup(data_dir=tmp_path, load_base_model=lambda: build_tiny_model(seed=0, tokenizer=tok))
    with pytest.raises(ConfigError, match="no loss family for objective 'mystery'"):
        TorchTrainer.from_config(Other(), setup, section, who="test")
    assert isinstance(TorchTrainer.from_config(fake_slime.ReinforceObjective(), setup, section, who="test"),
                      SlimeTrainer)
    with pytest.raises(ConfigError, match="unknown trainer.backend 'nope'"):
        TorchTrainer.from_config(Other(), setup, TrainerConfig(backend="nope"), who="test")


# --------------------------------------------------------------------------- over HTTP


@pytest.mark.slow  # a server, the local tiny engine and one fake slime job in a subprocess (25-60 s)
def test_a_slime_step_is_published_and_served_by_the_local_engine(tmp_path):
    import httpx
    import openai

    from reef_core.loop.assemble import build_deployment
    from reef_core.plugins import PluginManager
    from reef_core.serve.app import create_app
    from reef_core.testing.fake_upstream import serve_asgi
    from reef_core.testing.fixtures import wait_until

    from .test_two_recipes_http import DuoPlugin, _step

    pm = PluginManager(load_entry_points=False, extra_plugins=(DuoPlugin,))
    launch = "[" + ",".join(LAUNCH) + "]"
    cfg = compose_config(["engine.kind=local", "engine.model=tiny", "engine.max_new_tokens=4", "engine.seed=0",
                          f"storage.data_dir={tmp_path}", "+recipe=duo_weights", "recipe.trainer=torch",
                          "+recipe.options.objective=reef_core.testing.fake_slime:ReinforceObjective",
                          "trainer.backend=slime", f"trainer.slime.launch={launch}"], pm)
    dep = build_deployment(cfg, pm)
    with serve_asgi(create_app(dep), lifespan="on") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        commits = _step(url, client, "slimed", 2)
        assert commits[-1]["decision"]["decision"] == "select", commits[-1]
        assert commits[-1]["metrics"]["slime_step"] == commits[-1]["step"]
        status = wait_until(lambda: (s := httpx.get(f"{url}/reef/scenarios/slimed/status").json())
                            ["current_version"].endswith(":1") and s, timeout=60, what="the slime release serving")
        releases = httpx.get(f"{url}/reef/scenarios/slimed/releases").json()["releases"]
        trained = [r for r in releases if r["operation"] == "training"]
        assert len(trained) == 1 and status["current_release_id"] == trained[0]["release_id"]
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "again"}], extra_headers={"x-reef-scenario": "slimed"})
        assert raw.status_code == 200
    (job,) = _jobs(tmp_path / "slime-jobs")
    assert job["phase"] == m.COMPLETE and job["release_id"] == trained[0]["release_id"]


def test_finish_merges_shards_writes_the_manifest_and_only_moves_a_running_job(tmp_path):
    from safetensors.torch import save_file

    from reef_core.grow.slime import jobs
    from reef_core.grow.slime.finish import finish

    job = tmp_path / "step-00000001-abc"
    (job / "checkpoint").mkdir(parents=True)
    save_file({"a": torch.ones(2)}, str(job / "checkpoint" / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(3)}, str(job / "checkpoint" / "model-00002-of-00002.safetensors"))
    (job / "checkpoint" / "config.json").write_text("{}")
    m.write_marker(job, m.RUNNING, job_id="abc", step=1, record_ids=[])
    finish(job)
    assert m.read_marker(job)["phase"] == m.CHECKPOINT
    files = jobs.read_checkpoint(job)
    assert sorted(files) == ["config.json", MODEL_FILE] and sorted(_weights(files)) == ["a", "b"]
    m.write_marker(job, m.ABANDONED)
    with pytest.raises(SystemExit, match="not RUNNING"):
        finish(job)
