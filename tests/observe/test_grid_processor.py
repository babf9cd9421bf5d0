"""The whole-step barrier (``grid``): a step of G groups x R rollouts trains only when complete, on one version."""

from __future__ import annotations

import itertools

import pytest

from reef_core.errors import ConfigError, ValidationFailed
from reef_core.observe.model import Record
from reef_core.observe.processors import GridProcessor
from reef_core.observe.records import RecordStore

SCENARIO = "grid"
G, R = 2, 3


class Grid:
    """Builds a scenario's inference + report records with grid coordinates, in store order."""

    def __init__(self):
        self._seq = itertools.count(1)
        self._ids = itertools.count(1)

    def inference(self, text: str, version: str = "inc:1") -> Record:
        n = next(self._ids)
        payload = {"route": "chat", "dialect": "openai", "client_dialect": "openai", "stream": False,
                   "request": {"model": "m", "messages": [{"role": "user", "content": text}]},
                   "response": {"object": "chat.completion",
                                "choices": [{"index": 0, "message": {"role": "assistant", "content": f"a{n}"}}]},
                   "engine": "test", "timings": {}}
        return Record(record_id=f"inf-{n}", scenario=SCENARIO, kind="inference", payload=payload, version=version,
                      sequence=next(self._seq))

    def report(self, ref: str, score: float, step: int, group: int, rollout: int, created_at=None) -> Record:
        extra = {"created_at": created_at} if created_at is not None else {}
        return Record(record_id=f"rep-{next(self._ids)}", scenario=SCENARIO, kind="report",
                      payload={"score": score, "metadata": {"step": step, "group": group, "rollout": rollout}},
                      references=[ref], sequence=next(self._seq), **extra)

    def rollout(self, step, group, rollout, score, version="inc:1", **kw) -> list[Record]:
        inf = self.inference(f"step {step} group {group}", version)
        return [inf, self.report(inf.record_id, score, step, group, rollout, **kw)]

    def step(self, step, scores, versions=None, skip=()) -> list[Record]:
        """Records of one step; ``scores[g][r]``; ``skip`` lists missing (group, rollout) slots."""
        out = []
        for g, row in enumerate(scores):
            for r, score in enumerate(row):
                if (g, r) not in skip:
                    out += self.rollout(step, g, r, score, (versions or {}).get((g, r), "inc:1"))
        return out


VARIED = [[0.0, 0.5, 1.0], [1.0, 2.0, 3.0]]


def feed(processor, records):
    for record in records:
        processor.ingest(record)


def test_complete_grid_trains_as_one_batch_with_its_coordinates():
    s, p = Grid(), GridProcessor(SCENARIO, groups=G, rollouts_per_group=R)
    records = s.step(0, VARIED)
    feed(p, records[:-2])
    assert not p.ready() and p.pending_batch() is None and p.status()["steps"] == {"0": G * R - 1}
    feed(p, records[-2:])
    assert p.ready()
    batch = p.pending_batch()
    coords = [smp.metadata["reef"]["grid"] for smp in batch.samples]
    assert [(c["step"], c["group"], c["rollout"]) for c in coords] == [(0, g, r) for g in range(G) for r in range(R)]
    assert all(c["groups"] == G and c["rollouts_per_group"] == R for c in coords)
    assert [smp.group_key for smp in batch.samples] == ["0:0"] * R + ["0:1"] * R
    assert [smp.reward for smp in batch.samples] == [x for row in VARIED for x in row]
    assert batch.samples[0].metadata["step"] == 0  # the report's own metadata is kept
    assert sorted(p.acknowledge(batch.batch_id)) == sorted(r.record_id for r in records)
    assert not p.ready() and p.status()["closed_steps"] == 1


def test_incomplete_step_never_trains_while_a_later_complete_one_does():
    s, p = Grid(), GridProcessor(SCENARIO, groups=G, rollouts_per_group=R)
    feed(p, s.step(0, VARIED, skip={(1, 2)}))
    feed(p, s.step(1, VARIED))
    batch = p.pending_batch()
    assert {smp.metadata["reef"]["grid"]["step"] for smp in batch.samples} == {1}
    p.acknowledge(batch.batch_id)
    assert not p.ready() and p.pending_batch() is None
    assert p.status()["open_steps"] == 1 and p.status()["dropped"] == {}


def test_a_slot_that_can_never_fill_drops_its_step_whole():
    s, p = Grid(), GridProcessor(SCENARIO, groups=G, rollouts_per_group=R)
    records = s.step(0, VARIED, skip={(0, 0)})
    ghost = s.report("no-such-inference", 1.0, 0, 0, 0)
    feed(p, [*records[:4], ghost, *records[4:]])
    status = p.status()
    assert not p.ready() and status["pending_units"] == 0
    assert status["dropped"] == {"unknown_reference": 1, "step_discarded": 2, "step_closed": G * R - 3}
    # A second report quoting a receipt another slot holds kills its own (empty) slot, not a filled one.
    p2 = GridProcessor(SCENARIO, groups=G, rollouts_per_group=R)
    records = s.step(1, VARIED, skip={(1, 2)})
    feed(p2, [*records, s.report(records[0].record_id, 1.0, 1, 0, 0)])  # slot (0, 0) is filled: harmless
    assert p2.status()["dropped"] == {"duplicate": 1} and p2.status()["pending_units"] == G * R - 1
    feed(p2, [s.report(records[0].record_id, 1.0, 1, 1, 2)])  # the missing slot, quoting a held receipt
    assert p2.status()["dropped"] == {"duplicate": 2, "step_discarded": G * R - 1}
    assert p2.status()["pending_units"] == 0 and p2.status()["closed_steps"] == 1


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_incomplete_step_times_out_whole_when_asked():
    clock = FakeClock()
    s = Grid()
    p = GridProcessor(SCENARIO, groups=G, rollouts_per_group=R, timeout_s=30, clock=clock)
    records = s.step(0, VARIED, skip={(0, 1)})
    for record in records:
        p.ingest(Record(**{**record.__dict__, "created_at": clock.now}))
    assert p.recheck_after() == pytest.approx(30)
    clock.now += 31
    assert p.recheck_after() == 0 and not p.ready()
    assert p.status()["dropped"] == {"incomplete_step": G * R - 1} and p.status()["pending_units"] == 0
    # The step is closed: its missing rollout arriving late does not reopen it, not even in a replay.
    late = [Record(**{**r.__dict__, "created_at": clock.now}) for r in s.rollout(0, 0, 1, 0.5)]
    feed(p, late)
    assert p.status()["dropped"]["step_closed"] == 1 and p.recheck_after() is None
    replay = GridProcessor(SCENARIO, groups=G, rollouts_per_group=R, timeout_s=30, clock=clock)
    feed(replay, [Record(**{**r.__dict__, "created_at": 1000.0}) for r in records] + late)
    assert not replay.ready() and replay.status()["dropped"] == {"incomplete_step": G * R - 1, "step_closed": 1}


def test_grid_spanning_two_versions_is_dropped_whole_with_its_reason():
    s, p = Grid(), GridProcessor(SCENARIO, groups=G, rollouts_per_group=R)
    feed(p, s.step(0, VARIED, versions={(1, 2): "inc:2"}))
    assert not p.ready() and p.pending_batch() is None
    status = p.status()
    assert status["dropped"] == {"mixed_versions": G * R} and status["pending_units"] == 0
    assert p.protected_ids() == set()
    feed(p, s.step(1, VARIED, versions={(g, r): "inc:2" for g in range(G) for r in range(R)}))
    assert len(p.pending_batch()) == G * R  # a step served by one (other) version trains


def test_inadmissible_rollout_discards_the_whole_step():
    serving = {"v": "inc:1"}
    s = Grid()
    p = GridProcessor(SCENARIO, groups=G, rollouts_per_group=R, max_staleness=0, serving_version=lambda: serving["v"])
    versions = {(g, r): "inc:2" for g in range(G) for r in range(R)} | {(0, 1): "inc:1"}
    feed(p, s.step(0, VARIED, versions=versions, skip={(0, 0)}))
    serving["v"] = "inc:2"
    assert not p.ready()
    assert p.status()["dropped"] == {"stale": 1, "step_discarded": G * R - 2}


def test_constant_groups_are_left_out_after_the_barrier_and_consumed_with_the_batch():
    s, p = Grid(), GridProcessor(SCENARIO, groups=3, rollouts_per_group=2)
    records = s.step(0, [[1.0, 1.0], [0.0, 1.0], [0.5, 0.5]])
    feed(p, records)
    batch = p.pending_batch()
    assert [smp.group_key for smp in batch.samples] == ["0:1", "0:1"]
    assert sorted(batch.record_ids) == sorted(r.record_id for r in records)  # the constant groups too
    assert p.protected_ids() == {r.record_id for r in records}
    p.release(batch.batch_id)  # released: the whole step waits again
    assert p.status()["pending_units"] == 6 and p.status()["dropped"] == {}
    batch = p.pending_batch()
    assert sorted(p.acknowledge(batch.batch_id)) == sorted(r.record_id for r in records)
    assert p.status()["dropped"] == {"constant_group": 4} and p.status()["samples_acknowledged"] == 2


def test_all_constant_groups_keep_the_first_so_the_step_still_trains():
    s, p = Grid(), GridProcessor(SCENARIO, groups=G, rollouts_per_group=R)
    feed(p, s.step(0, [[0.0] * R, [1.0] * R]))
    batch = p.pending_batch()
    assert [smp.group_key for smp in batch.samples] == ["0:0"] * R and len(batch.record_ids) == 2 * G * R
    p.drop(batch.batch_id, "trainer_failed")
    assert p.status()["dropped"] == {"trainer_failed": R, "constant_group": R}


def test_duplicate_slots_and_closed_steps_never_train():
    s, p = Grid(), GridProcessor(SCENARIO, groups=G, rollouts_per_group=R)
    feed(p, s.step(0, VARIED, skip={(1, 2)}))
    feed(p, s.rollout(0, 0, 0, 9.0))  # the slot is taken: the first report wins
    assert p.status()["dropped"] == {"duplicate": 1}
    feed(p, s.rollout(0, 1, 2, 1.0))
    batch = p.pending_batch()
    assert batch.samples[0].reward == 0.0
    feed(p, s.rollout(0, 1, 0, 7.0))  # while the step is reserved
    assert p.status()["dropped"] == {"duplicate": 2}
    p.acknowledge(batch.batch_id)
    feed(p, s.rollout(0, 1, 1, 1.0))
    assert p.status()["dropped"] == {"duplicate": 2, "step_closed": 1} and not p.ready()


def test_restart_replays_nothing_that_the_step_consumed(tmp_path):
    store = RecordStore.open(None, tmp_path)
    try:
        s = Grid()

        def append(records):
            return [store.append_sync(Record(**{**r.__dict__, "sequence": None})) for r in records]

        append(s.step(0, [[1.0] * R, [0.0, 1.0, 2.0]]))  # group 0 is constant: left out, but consumed
        append(s.step(1, VARIED, skip={(0, 0)}))
        first = GridProcessor(SCENARIO, groups=G, rollouts_per_group=R, load_records=lambda ids: store.get_many(SCENARIO, ids))
        feed(first, store.replay(SCENARIO))
        batch = first.pending_batch()
        store.mark_consumed(SCENARIO, first.acknowledge(batch.batch_id), step=1)

        append(s.rollout(0, 0, 0, 5.0))  # a late report for the trained step, stored after the restart
        restarted = GridProcessor(SCENARIO, groups=G, rollouts_per_group=R, load_records=lambda ids: store.get_many(SCENARIO, ids))
        restarted.restore(store.consumed_ids(SCENARIO))
        feed(restarted, store.replay(SCENARIO))
        status = restarted.status()
        assert not restarted.ready() and restarted.pending_batch() is None
        assert status["replayed_consumed"] == G * R and status["dropped"] == {"step_closed": 1}
        assert status["steps"] == {"1": G * R - 1}  # step 1 still waits for its missing slot
        append(s.rollout(1, 0, 0, 0.25))
        feed(restarted, store.replay(SCENARIO, restarted.last_sequence))
        batch = restarted.pending_batch()
        assert {smp.metadata["reef"]["grid"]["step"] for smp in batch.samples} == {1}
    finally:
        store.close()


@pytest.mark.parametrize("metadata, field", [
    (None, "metadata"),
    ({"group": 0, "rollout": 0}, "metadata.step"),
    ({"step": -1, "group": 0, "rollout": 0}, "metadata.step"),
    ({"step": True, "group": 0, "rollout": 0}, "metadata.step"),
    ({"step": 0, "group": G, "rollout": 0}, "metadata.group"),
    ({"step": 0, "group": 0, "rollout": 1.0}, "metadata.rollout"),
    ({"step": 0, "group": 0, "rollout": R}, "metadata.rollout"),
    ({"step": 0, "group": 0, "rollout": 0, "groups_per_step": G + 1}, "metadata.groups_per_step"),
    ({"step": 0, "group": 0, "rollout": 0, "rollouts_per_group": R - 1}, "metadata.rollouts_per_group"),
])
def test_report_key_refuses_bad_coordinates_naming_the_field(metadata, field):
    p = GridProcessor(SCENARIO, groups=G, rollouts_per_group=R)
    with pytest.raises(ValidationFailed) as err:
        p.report_key({"score": 1.0, "references": ["x"], "metadata": metadata})
    assert err.value.param == field


def test_report_key_names_the_slot_and_needs_a_score_and_a_receipt():
    p = GridProcessor(SCENARIO, groups=G, rollouts_per_group=R)
    meta = {"step": 4, "group": 1, "rollout": 2, "groups_per_step": G, "rollouts_per_group": R}
    assert p.report_key({"score": 1.0, "references": ["x"], "metadata": meta}) == "reef-grid/4/1/2"
    for report, field in (({"references": ["x"], "metadata": meta}, "score"),
                          ({"score": 1.0, "references": [], "metadata": meta}, "references")):
        with pytest.raises(ValidationFailed) as err:
            p.report_key(report)
        assert err.value.param == field


def test_grid_factory_is_registered_and_checks_its_options():
    from reef_core.plugins import PluginManager

    pm = PluginManager(load_entry_points=False)
    make = pm.get("processor", "grid").factory
    p = make(scenario=SCENARIO, options={"groups": 8, "rollouts-per-group": 4, "batch_size": 32},
             serving_version=lambda: None)
    assert isinstance(p, GridProcessor) and p.status()["groups"] == 8 and p.status()["rollouts_per_group"] == 4
    for options, needle in (({"groups": 8}, "rollouts_per_group"),
                            ({"groups": 8, "rollouts_per_group": 4, "batch_size": 30}, "batch_size"),
                            ({"groups": 0, "rollouts_per_group": 4}, "groups"),
                            ({"groups": 2, "rollouts_per_group": 2, "require_score": False}, "no option"),
                            ({"groups": 2, "rollouts_per_group": 2, "timeout_s": 0}, "timeout_s")):
        with pytest.raises(ConfigError, match=needle):
            make(scenario=SCENARIO, options=options, serving_version=lambda: None)


def test_constant_groups_stay_in_the_batch_when_the_recipe_asks():
    s, p = Grid(), GridProcessor(SCENARIO, groups=G, rollouts_per_group=R, drop_constant_groups=False)
    records = s.step(0, [[1.0, 1.0, 1.0], [0.0, 0.5, 1.0]])
    feed(p, records)
    batch = p.pending_batch()
    assert [smp.group_key for smp in batch.samples] == ["0:0"] * R + ["0:1"] * R
    p.acknowledge(batch.batch_id)
    assert "constant_group" not in p.status()["dropped"]


def test_sequential_grid_accepts_only_its_open_step():
    s, p = Grid(), GridProcessor(SCENARIO, groups=G, rollouts_per_group=R, sequential=True)
    report = {"score": 1.0, "references": ["inf-1"], "metadata": {"step": 1, "group": 0, "rollout": 0}}
    with pytest.raises(ValidationFailed) as info:
        p.report_key(report)
    assert info.value.param == "metadata.step" and "open step is 0" in info.value.message
    assert p.report_key({**report, "metadata": {"step": 0, "group": 0, "rollout": 0}}) == "reef-grid/0/0/0"
    records = s.step(0, VARIED)
    feed(p, records)
    batch = p.pending_batch()
    assert p.current_step() == 0  # training: step 1 is not open yet
    p.acknowledge(batch.batch_id)
    assert p.current_step() == 1 and p.status()["current_step"] == 1
    assert p.report_key(report) == "reef-grid/1/0/0"
    feed(p, s.step(1, VARIED, versions={(0, 0): "inc:2"}))  # mixed versions: dropped, the next step opens
    assert not p.ready() and p.current_step() == 2
