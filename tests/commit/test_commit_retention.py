"""Retention: GC plans never touch the current release; pruning keeps the chain auditable."""

from __future__ import annotations

import random
import shutil

import pytest

from reef_core.commit import GitArtifactStore, RetentionPolicy, plan_gc, run_gc
from reef_core.errors import Conflict, ValidationFailed
from reef_core.testing.chain import promote, publish, rollback


def w(seed: int) -> bytes:
    return random.Random(seed).randbytes(20_000)


@pytest.fixture(scope="module")
def _template(tmp_path_factory):
    """c1 -> c2 -> c3 -> rollback(c1) served; plus a held candidate never promoted.

    Built once; each test works on its own copy of the repository.
    """
    root = tmp_path_factory.mktemp("retention")
    s = GitArtifactStore(root / "artifacts.git", root / "work")
    c1 = publish(s, "s", {"m.safetensors": w(1), "cfg.json": b"1"}, expected_parent=None)
    c2 = publish(s, "s", {"m.safetensors": w(2), "cfg.json": b"2"}, expected_parent=c1.release_id)
    c3 = publish(s, "s", {"m.safetensors": w(3), "cfg.json": b"3"}, expected_parent=c2.release_id)
    held = publish(s, "s", {"m.safetensors": w(4)}, expected_parent=c3.release_id, hold=True)
    head = rollback(s, "s", c1.release_id, expected_head=c3.release_id)
    return root / "artifacts.git", {"c1": c1, "c2": c2, "c3": c3, "held": held, "head": head}


@pytest.fixture
def release_store(_template, tmp_path):
    shutil.copytree(_template[0], tmp_path / "artifacts.git", symlinks=True)
    return GitArtifactStore(tmp_path / "artifacts.git", tmp_path / "work")


@pytest.fixture
def history(_template):
    return _template[1]


def oid(rel) -> str:
    return rel.files["m.safetensors"]["sha256"]


def test_default_policy_only_frees_never_served_releases(release_store, history):
    plan = plan_gc(release_store, RetentionPolicy(keep_last=1))
    assert plan.prune_releases == [history["held"].release_id]
    assert plan.delete_objects == [oid(history["held"])]
    assert history["head"].release_id in plan.retained
    assert plan.reasons[history["c2"].release_id] == "ever current"


def test_dry_run_lists_and_deletes_nothing(release_store, history):
    plan = plan_gc(release_store, RetentionPolicy(keep_last=1, keep_ever_current=False))
    assert set(plan.prune_releases) == {history[k].release_id for k in ("c2", "c3", "held")}
    # The current head shares its weights with c1: neither is listed, nor are their bytes.
    assert history["head"].release_id not in plan.prune_releases
    assert history["c1"].release_id not in plan.prune_releases
    assert oid(history["head"]) not in plan.delete_objects
    result = run_gc(release_store, plan, dry_run=True)
    assert result.dry_run and result.deleted_objects == plan.delete_objects
    assert all(release_store.lfs_path(o).exists() for o in plan.delete_objects)
    assert all(r.restorable for r in release_store.releases("s"))


def test_gc_prunes_weights_but_keeps_the_chain(release_store, history):
    policy = RetentionPolicy(keep_last=1, keep_ever_current=False, pinned={history["c2"].release_id})
    plan = plan_gc(release_store, policy)
    assert set(plan.prune_releases) == {history["c3"].release_id, history["held"].release_id}
    result = run_gc(release_store, plan, dry_run=False)
    assert not result.dry_run and result.reclaimed_bytes == 2 * 20_000
    assert not release_store.lfs_path(oid(history["c3"])).exists()
    rows = {r.release_id: r for r in release_store.releases("s")}
    assert len(rows) == 5  # every release still listed: nothing in git was removed
    assert not rows[history["c3"].release_id].restorable
    assert rows[history["c2"].release_id].restorable and rows[history["head"].release_id].restorable
    with pytest.raises(Conflict, match="not restorable"):
        rollback(release_store, "s", history["c3"].release_id, expected_head=history["head"].release_id)
    with pytest.raises(Conflict):
        release_store.read_files(history["c3"].release_id)
    assert release_store.read_files(history["c2"].release_id)["m.safetensors"] == w(2)
    assert release_store.read_files(history["head"].release_id)["m.safetensors"] == w(1)
    # The small files of a pruned release stay auditable in git.
    assert release_store.get(history["c3"].release_id).files["cfg.json"]["size"] == 1
    assert plan_gc(release_store, policy).delete_objects == []


def test_gc_rechecks_under_its_lock_and_removes_orphans(release_store, history):
    plan = plan_gc(release_store, RetentionPolicy(keep_last=1))
    # After planning, the held candidate is promoted: its weights are current now.
    promote(release_store, "s", history["held"].release_id, expected_head=history["head"].release_id)
    assert run_gc(release_store, plan, dry_run=False).deleted_objects == []
    assert release_store.read_files(release_store.head("s").release_id)["m.safetensors"] == w(4)
    # A staged-then-abandoned release leaves an orphan object: GC removes it.
    staged = release_store.stage("s", {"x.bin": b"orphan"}, expected_parent=release_store.head("s").release_id)
    release_store.discard(staged.release_id)
    orphan = staged.files["x.bin"]["sha256"]
    plan = plan_gc(release_store, RetentionPolicy())
    assert plan.orphan_objects == [orphan] and plan.prune_releases == []
    run_gc(release_store, plan, dry_run=False)
    assert not release_store.lfs_path(orphan).exists()


def test_policy_validation():
    with pytest.raises(ValidationFailed):
        RetentionPolicy(keep_last=0)


def test_an_aliased_release_keeps_its_weights(release_store, history):
    # The held candidate is what the default policy frees; an alias pointing at it keeps it (and a served one too).
    aliases = release_store.aliases()
    aliases.move("s", "staging", history["held"].release_id, by="t", reason="candidate under evaluation")
    aliases.move("s", "old", history["c2"].release_id, by="t", reason="baseline")
    plan = plan_gc(release_store, RetentionPolicy(keep_last=1, keep_ever_current=False))
    assert plan.reasons[history["held"].release_id] == "alias staging"
    assert plan.reasons[history["c2"].release_id] == "alias old"
    assert plan.prune_releases == [history["c3"].release_id]
    result = run_gc(release_store, plan, dry_run=False)
    assert result.pruned_releases == [history["c3"].release_id]
    for kept in ("held", "c2"):
        assert release_store.get(history[kept].release_id).restorable
        assert release_store.read_files(history[kept].release_id)["m.safetensors"] == w(4 if kept == "held" else 2)
