"""The archive and PUCT parent selection (recipes reference §5.2, §5.5 assertion 6)."""

from __future__ import annotations

import json

from reef_ttt.archive import Archive, Child, Entry


def _archive(**knobs) -> Archive:
    return Archive.seeded([("a", 0.1), ("b", 0.5), ("c", 0.3)], **knobs)


def test_unvisited_top_value_state_is_picked_first():
    archive = _archive()
    assert archive.select(1) == ["seed-1"]
    # once visited, the exploration bonus of the others wins over it
    archive.entries["seed-1"].visits = 50
    archive.expansions = 50
    assert archive.select(1) != ["seed-1"]


def test_lineage_blocking_never_puts_parent_and_descendant_in_one_step():
    archive = _archive()
    archive.update(0, [Child("seed-1", "b1", 0.9, rollout=0), Child("seed-1", "b2", 0.8, rollout=1)])
    picks = archive.select(3)
    assert len(set(picks)) == 3
    for p in picks:
        family = archive.lineage(p)
        assert not any(q in family for q in picks if q != p)
    # the children are picked (siblings are not each other's lineage), so their parent is blocked
    assert "s0-g0-r0" in picks and "seed-1" not in picks


def test_picks_repeat_when_lineages_run_out():
    archive = Archive.seeded([("only", 1.0)])
    assert archive.select(3) == ["seed-0"] * 3


def test_at_most_two_children_per_parent_and_dedupe():
    archive = _archive()
    kids = [Child("seed-0", f"x{i}", 0.1 * i, rollout=i) for i in range(5)]
    kids.append(Child("seed-0", "b", 2.0, rollout=5))  # the same state as seed-1: a duplicate
    counters = archive.update(0, kids)
    children = [e for e in archive.entries.values() if e.parent == "seed-0"]
    assert sorted(e.state for e in children) == ["x3", "x4"]
    assert counters["added"] == 2 and counters["duplicates"] == 1


def test_visits_propagate_to_ancestors_and_failures_count():
    archive = _archive()
    archive.update(0, [Child("seed-1", "b1", 0.9)])
    archive.update(1, [Child("s0-g0-r0", "b11", 1.0, rollout=0), Child("s0-g0-r0", None, None, rollout=1),
                       Child("s0-g0-r0", "junk", None, rollout=2)])
    assert archive.entries["s1-g0-r0"].parent == "s0-g0-r0"
    assert archive.entries["s0-g0-r0"].visits == 3  # one expansion + two failed rollouts
    assert archive.entries["seed-1"].visits == 4  # its own expansion in step 0 + the three above
    assert archive.entries["seed-0"].visits == 0
    assert archive.expansions == 4
    assert archive.entries["s0-g0-r0"].best_child == 1.0 and archive.entries["seed-1"].best_child == 0.9


def test_best_only_rises_and_history_has_one_entry_per_update():
    archive = _archive()
    archive.update(0, [Child("seed-0", "low", 0.01)])
    archive.update(1, [Child("seed-1", "high", 0.7)])
    archive.update(2, [Child("seed-2", None, None)])
    assert archive.history == [0.5, 0.7, 0.7]
    assert archive.summary()["best"] == {"score": 0.7, "state": "high", "step": 1}


def test_cap_keeps_seeds_and_the_best():
    archive = _archive(cap=4)
    archive.update(0, [Child("seed-0", f"s{i}", v, rollout=i) for i, v in enumerate([0.05, 0.9])])
    archive.update(1, [Child("seed-2", f"t{i}", v, rollout=i) for i, v in enumerate([0.02, 0.01])])
    assert len(archive.entries) == 4
    assert {e.state for e in archive.entries.values()} == {"a", "b", "c", "s1"}


def test_scale_uses_non_seed_values_and_plans_are_deterministic():
    archive = _archive()
    archive.update(0, [Child("seed-0", "p", 0.2, rollout=0), Child("seed-0", "q", 0.6, rollout=1)])
    again = Archive.from_json(json.loads(json.dumps(archive.to_json())))
    assert again.select(3) == archive.select(3)
    assert again.scores() == archive.scores()
    entries = archive.entries
    n = len(entries)
    ranks = {e.id: r for r, e in enumerate(sorted(entries.values(), key=lambda e: (-e.value, e.id)))}
    total = sum(n - r for r in ranks.values())
    e = entries["seed-2"]
    expected = e.q() + 1.0 * (0.6 - 0.2) * ((n - ranks[e.id]) / total) * (1 + archive.expansions) ** 0.5 / 1
    assert abs(archive.scores()["seed-2"] - expected) < 1e-12
    assert isinstance(entries["seed-0"], Entry)
