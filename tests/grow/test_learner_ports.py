"""A learner built from its ports alone (no deployment): it sleeps until woken, trains on the pool,
and every commit-log row goes through the committer."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from reef_core.commit.git_store import GitArtifactStore
from reef_core.config.schema import EvaluationConfig, RecipeConfig, TrainerConfig
from reef_core.grow.trainer import CandidateUpdate, Trainer
from reef_core.loop.learner import ScenarioLearner
from reef_core.loop.pool import LearnerPool
from reef_core.loop.ports import LearnerPorts, LearnerSettings, ServingPorts
from reef_core.observe.processor import Batch, Processor
from reef_core.plugins import PluginManager
from reef_core.surfaces.harness import HarnessSurface
from reef_core.testing.fixtures import wait_until


class Records:
    """The record port: the scenario's stream and its consumption marks, in memory."""

    def __init__(self):
        self.rows: list[SimpleNamespace] = []
        self.consumed: dict[str, int] = {}

    def add(self, record_id: str) -> None:
        self.rows.append(SimpleNamespace(record_id=record_id, kind="inference", sequence=len(self.rows) + 1))

    def replay(self, scenario, after_sequence=0):
        return iter([r for r in self.rows if r.sequence > after_sequence])

    def consumed_ids(self, scenario):
        return set(self.consumed)

    def mark_consumed(self, scenario, ids, step):
        for rid in ids:
            self.consumed.setdefault(rid, step)
        return len(ids)

    def get_many(self, ids):
        by_id = {r.record_id: r for r in self.rows}
        return [by_id.get(rid) for rid in ids]


class EveryRecord(Processor):
    """One batch per ingested record."""

    def __init__(self, scenario, **_):
        super().__init__(scenario)
        self.waiting: list[str] = []

    def ingest(self, record):
        self.waiting.append(record.record_id)

    def ready(self):
        return bool(self.waiting)

    def pending_batch(self):
        return Batch(f"b-{self.waiting[0]}", [], [self.waiting[0]], self.scenario) if self.waiting else None

    def acknowledge(self, batch_id):
        return [self.waiting.pop(0)]

    def release(self, batch_id):
        pass

    def drop(self, batch_id, reason):
        return self.acknowledge(batch_id)

    def restore(self, consumed_ids):
        pass

    def status(self):
        return {"pending_units": len(self.waiting)}


class Rewriter(Trainer):
    artifact_kind = "harness"

    def initial_files(self):
        return {"system_prompt.md": b"v0"}

    def train(self, batch, ctx):
        text = f"v{ctx.step}"
        return CandidateUpdate(files={"system_prompt.md": text.encode()}, payload={"system_prompt.md": text})


def _threads() -> int:
    """Live threads but the release store's process-wide fsync pool (fixed size, shared by every scenario)."""
    return sum(1 for t in threading.enumerate() if not t.name.startswith("reef-fsync"))


def test_a_learner_needs_only_its_ports(tmp_path):
    artifacts = GitArtifactStore(tmp_path / "artifacts.git", tmp_path / "work")
    serving = ServingPorts(engine=None, artifacts=artifacts, run_async=None, load_base_model=None)
    surface = HarnessSurface(artifacts, {"inject": "system"})
    pm = PluginManager(load_entry_points=False)
    built = {"processor": EveryRecord, "trainer": lambda **_: Rewriter()}
    published = []

    def create(kind, name, **kwargs):
        return built[kind](**kwargs) if kind in built else pm.create(kind, name, **kwargs)

    records = Records()
    pool = LearnerPool(workers=1)
    ports = LearnerPorts(serving=serving, records=records, create=create, pool=pool,
                         notify=lambda hook, **kw: published.append(kw["release"].release_id))
    settings = LearnerSettings(data_dir=tmp_path, seed=0, trainer=TrainerConfig(), evaluation=EvaluationConfig())
    recipe = RecipeConfig(name="test", processor="every", trainer="rewriter", surface="harness")
    learner = ScenarioLearner("s", recipe, surface, ports, settings)
    threads = _threads()
    learner.start()  # recovery, then the creation release from the trainer's initial files
    assert surface.system_text("s") == "v0" and learner.log.last_step() == 1
    assert pool.wait_idle("s", 10) and learner.state() == "idle"
    assert _threads() <= threads + 1  # at most the pool's one worker, no thread per scenario

    records.add("r1")
    learner.wake()
    wait_until(lambda: learner.log.last_step() == 2, 30)
    assert pool.wait_idle("s", 10)
    assert surface.system_text("s") == "v2"
    assert records.consumed == {"r1": 2} and published == [learner.head.release_id]
    assert learner.log.last_row()["consumed_ids"] == ["r1"]
    assert learner.status()["learner"] == "idle"

    learner.stop()
    records.add("r2")
    learner.wake()  # a stopped learner takes no more turns
    assert pool.wait_idle("s", 5) and learner.log.last_step() == 2
    pool.close()
