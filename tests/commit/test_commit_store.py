"""GitArtifactStore against a real bare repository, real git and real git-lfs."""

from __future__ import annotations

import json
import os
import random
import subprocess

import pytest

from reef_core.commit import GitArtifactStore, check_git_lfs
from reef_core.commit.release import scenario_ref
from reef_core.errors import ConfigError, Conflict, NotFound, ValidationFailed
from reef_core.testing.chain import promote, publish, rollback

LFS_POINTER_HEADER = "version https://git-lfs.github.com/spec/v1"


def weights(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def test_bare_repo_created_with_durable_config(tmp_path, git):
    store = GitArtifactStore(tmp_path / "data" / "artifacts.git", tmp_path / "work")
    repo = tmp_path / "data" / "artifacts.git"
    assert git("rev-parse", "--is-bare-repository", cwd=repo).strip() == "true"
    assert git("config", "core.logAllRefUpdates", cwd=repo).strip() == "always"
    assert git("config", "core.fsync", cwd=repo).strip() == "committed"
    assert store.scenarios() == [] and store.head("s") is None


def test_missing_git_lfs_is_a_clear_config_error(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    real_git = subprocess.run(["which", "git"], capture_output=True, text=True).stdout.strip()
    os.symlink(real_git, bindir / "git")
    monkeypatch.setenv("PATH", str(bindir))
    with pytest.raises(ConfigError, match="git-lfs is not installed.*apt-get install git-lfs"):
        check_git_lfs()
    with pytest.raises(ConfigError, match="git-lfs"):
        GitArtifactStore(tmp_path / "a.git", tmp_path / "w")


def test_publish_chain_manifest_and_cas(release_store, git):
    s = release_store
    r1 = publish(s, "agent/a", {"prompt.md": b"v1"}, expected_parent=None, operation="creation")
    assert r1.current and r1.parent_release_id is None and r1.operation == "creation"
    r2 = publish(s, 
        "agent/a",
        {"prompt.md": b"v2", "sub/dir/x.txt": b"x"},
        expected_parent=r1.release_id,
        metrics={"loss": 0.5},
        evaluation={"evaluator": "exact", "scores": [1.0]},
        source={"kind": "training", "job": "j1"},
    )
    # The manifest is in the commit, with the gate alias and the parent link.
    manifest = json.loads(git("cat-file", "blob", f"{r2.release_id}:reef-artifact.json", cwd=s.git_dir))
    assert manifest["parent_release_id"] == r1.release_id
    assert manifest["content_id"] == r2.content_id
    assert manifest["evaluation"] == manifest["gate"] == {"evaluator": "exact", "scores": [1.0]}
    assert manifest["source"] == {"kind": "training", "job": "j1"} and manifest["metrics"] == {"loss": 0.5}
    assert {"created_at", "operation"} <= manifest.keys()
    attrs = git("cat-file", "blob", f"{r2.release_id}:.gitattributes", cwd=s.git_dir)
    for pattern in ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt"):
        assert f"{pattern} filter=lfs diff=lfs merge=lfs -text" in attrs
    # The head moved by CAS; a stale expected parent is a conflict and moves nothing.
    assert git("rev-parse", scenario_ref("agent/a"), cwd=s.git_dir).strip() == r2.release_id
    assert git("rev-parse", "refs/reef/head", cwd=s.git_dir).strip() == r2.release_id
    with pytest.raises(Conflict):
        publish(s, "agent/a", {"prompt.md": b"v3"}, expected_parent=r1.release_id)
    with pytest.raises(Conflict):
        publish(s, "agent/a", {"prompt.md": b"v3"}, expected_parent=None)
    assert s.head("agent/a").release_id == r2.release_id
    assert s.staged() == []  # losers leave nothing in flight
    rows = s.releases("agent/a")
    assert [r.release_id for r in rows] == [r2.release_id, r1.release_id]
    assert [r.current for r in rows] == [True, False]
    assert s.read_files(r2.release_id) == {"prompt.md": b"v2", "sub/dir/x.txt": b"x"}
    assert s.get(f"git+lfs://{r1.release_id}").content_id == r1.content_id
    assert s.scenarios() == ["agent/a"]


def test_invalid_input_and_unknown_ids(release_store):
    s = release_store
    for bad in ({"../x": b""}, {"reef-artifact.json": b""}, {".gitattributes": b""}, {".git/config": b""}):
        with pytest.raises(ValidationFailed):
            publish(s, "s", bad, expected_parent=None)
    with pytest.raises(ValidationFailed):
        publish(s, "s", {"a": b"1", "a/b": b"2"}, expected_parent=None)
    with pytest.raises(NotFound):
        s.get("0" * 40)
    with pytest.raises(NotFound):
        s.get("HEAD~1")
    assert s.staged() == []


def test_lfs_pointer_in_git_and_clone_restores_bytes(release_store, tmp_path, git):
    s = release_store
    blob = weights(2_000_000, seed=1)
    rel = publish(s, 
        "lora",
        {"adapter/model.safetensors": blob, "adapter/config.json": b'{"r": 8}'},
        expected_parent=None,
    )
    # In git the weights are a small pointer, the real bytes are in the LFS store.
    stored = git("cat-file", "blob", f"{rel.release_id}:adapter/model.safetensors", cwd=s.git_dir)
    assert stored.startswith(LFS_POINTER_HEADER) and len(stored) < 200
    assert rel.files["adapter/model.safetensors"]["lfs"] is True
    assert rel.files["adapter/config.json"]["lfs"] is False

    # A plain git user: clone without smudging, list LFS files, then `git lfs pull`.
    clone = tmp_path / "clone"
    env = {**os.environ, "GIT_LFS_SKIP_SMUDGE": "1"}
    git("clone", "--quiet", "--no-checkout", str(s.git_dir), str(clone), env=env)
    git("fetch", "--quiet", "origin", f"{scenario_ref('lora')}:refs/remotes/origin/lora", cwd=clone, env=env)
    git("checkout", "--quiet", "--detach", "origin/lora", cwd=clone, env=env)
    assert "adapter/model.safetensors" in git("lfs", "ls-files", cwd=clone)
    assert (clone / "adapter/model.safetensors").read_bytes().startswith(LFS_POINTER_HEADER.encode())
    git("lfs", "pull", cwd=clone)
    assert (clone / "adapter/model.safetensors").read_bytes() == blob
    assert (clone / "adapter/config.json").read_bytes() == b'{"r": 8}'

    # The store's own readers resolve LFS content byte-identically, cached per release.
    assert s.read_files(rel.release_id)["adapter/model.safetensors"] == blob
    first = s.materialize(rel.release_id)
    assert (first / "adapter/model.safetensors").read_bytes() == blob
    mtime = (first / "adapter/model.safetensors").stat().st_mtime_ns
    assert s.materialize(rel.release_id) == first
    assert (first / "adapter/model.safetensors").stat().st_mtime_ns == mtime  # reused, not rewritten
    dest = s.materialize(rel.release_id, tmp_path / "out")
    assert (dest / "adapter/model.safetensors").read_bytes() == blob


def test_file_values_may_be_paths(release_store, tmp_path):
    src = tmp_path / "big.bin"
    src.write_bytes(weights(100_000, seed=2))
    rel = publish(release_store, "s", {"w.bin": src, "empty.pt": b""}, expected_parent=None)
    assert rel.files["w.bin"]["lfs"] and rel.files["empty.pt"]["size"] == 0
    assert release_store.read_files(rel.release_id) == {"w.bin": src.read_bytes(), "empty.pt": b""}


def test_rollback_republishes_same_content_and_keeps_history(release_store, git):
    s = release_store
    w1, w2 = weights(50_000, 3), weights(50_000, 4)
    r1 = publish(s, "s", {"m.safetensors": w1, "cfg": b"1"}, expected_parent=None, metrics={"score": 1})
    r2 = publish(s, "s", {"m.safetensors": w2, "cfg": b"2"}, expected_parent=r1.release_id)
    assert r1.content_id != r2.content_id
    with pytest.raises(Conflict):  # stale expected head
        rollback(s, "s", r1.release_id, expected_head=r1.release_id)
    rb = rollback(s, "s", r1.release_id, expected_head=r2.release_id)
    assert rb.release_id not in (r1.release_id, r2.release_id)
    assert rb.content_id == r1.content_id
    assert rb.operation == "rollback" and rb.parent_release_id == r2.release_id
    assert rb.source == {"kind": "rollback", "release_id": r1.release_id, "content_id": r1.content_id}
    assert s.read_files(rb.release_id) == {"m.safetensors": w1, "cfg": b"1"}
    rows = s.releases("s")
    assert [r.release_id for r in rows] == [rb.release_id, r2.release_id, r1.release_id]
    assert [r.operation for r in rows] == ["rollback", "training", "training"]
    assert all(r.restorable for r in rows) and rows[0].current
    # History is append-only: every older release is an ancestor of the new head.
    for old in (r1, r2):
        git("merge-base", "--is-ancestor", old.release_id, rb.release_id, cwd=s.git_dir)
    with pytest.raises(NotFound):
        rollback(s, "s", "f" * 40, expected_head=rb.release_id)
    other = publish(s, "other", {"x": b"1"}, expected_parent=None)
    with pytest.raises(NotFound):  # a release of another scenario
        rollback(s, "s", other.release_id, expected_head=rb.release_id)


def test_review_hold_then_promote(release_store, git):
    s = release_store
    base = publish(s, "s", {"p": b"base"}, expected_parent=None)
    held = publish(s, "s", {"p": b"candidate"}, expected_parent=base.release_id, hold=True, metrics={"win": 3})
    assert held.pending and not held.current
    assert s.head("s").release_id == base.release_id  # serving did not change
    assert git("rev-parse", f"refs/reef/releases/{held.release_id}", cwd=s.git_dir).strip() == held.release_id
    rows = s.releases("s")
    assert [(r.release_id, r.pending, r.current) for r in rows] == [
        (held.release_id, True, False),
        (base.release_id, False, True),
    ]
    with pytest.raises(Conflict):  # pending releases are promoted, not rolled back to
        rollback(s, "s", held.release_id, expected_head=base.release_id)
    with pytest.raises(Conflict):
        promote(s, "s", base.release_id, expected_head=base.release_id)
    promoted = promote(s, "s", held.release_id, expected_head=base.release_id)
    assert promoted.operation == "promote" and promoted.current
    assert promoted.content_id == held.content_id and promoted.metrics == {"win": 3}
    assert s.read_files(promoted.release_id) == {"p": b"candidate"}
    assert s.get(held.release_id).pending is False
    with pytest.raises(Conflict):  # promoting twice
        promote(s, "s", held.release_id, expected_head=promoted.release_id)
    ops = [(r.operation, r.pending, r.current) for r in s.releases("s")]
    assert ops == [("promote", False, True), ("training", False, False), ("training", False, False)]


def test_archive_moves_the_ref_and_destroys_nothing(release_store, git):
    s = release_store
    r1 = publish(s, "gone", {"a": b"1"}, expected_parent=None)
    r2 = publish(s, "gone", {"a": b"2"}, expected_parent=r1.release_id)
    publish(s, "kept", {"a": b"k"}, expected_parent=None)
    with pytest.raises(Conflict):
        s.archive("gone", expected_head=r1.release_id)
    ref = s.archive("gone", expected_head=r2.release_id)
    assert ref.startswith("refs/reef/archived/")
    assert s.scenarios() == ["kept"] and s.head("gone") is None
    assert git("rev-parse", ref, cwd=s.git_dir).strip() == r2.release_id
    assert [a["release_id"] for a in s.archived("gone")] == [r2.release_id]
    assert s.read_files(r1.release_id) == {"a": b"1"}  # still readable, state "archived"
    assert s.get(r1.release_id).state == "archived"
    with pytest.raises(NotFound):
        s.archive("gone")
    fresh = publish(s, "gone", {"a": b"new"}, expected_parent=None)  # the name can be reused
    assert fresh.parent_release_id is None


def test_remote_repository_through_a_mirror(tmp_path, git):
    remote = tmp_path / "remote.git"
    git("init", "--quiet", "--bare", str(remote))
    url = f"file://{remote}"
    a = GitArtifactStore(url, tmp_path / "wa")
    b = GitArtifactStore(url, tmp_path / "wb")
    blob = weights(30_000, 5)
    r1 = publish(a, "s", {"m.bin": blob}, expected_parent=None)
    assert git("rev-parse", scenario_ref("s"), cwd=remote).strip() == r1.release_id
    assert (remote / "lfs" / "objects" / r1.files["m.bin"]["sha256"][:2]).is_dir()
    # The second machine sees the release, reads the LFS bytes, and loses a stale race.
    assert b.head("s").release_id == r1.release_id
    assert b.read_files(r1.release_id) == {"m.bin": blob}
    r2 = publish(b, "s", {"m.bin": b"plain"}, expected_parent=r1.release_id)
    with pytest.raises(Conflict):
        publish(a, "s", {"m.bin": b"stale"}, expected_parent=r1.release_id)
    rb = rollback(a, "s", r1.release_id, expected_head=r2.release_id)
    assert rb.content_id == r1.content_id
    assert [r.release_id for r in b.releases("s")] == [rb.release_id, r2.release_id, r1.release_id]


def test_cas_on_the_ref_decides_between_two_staged_releases(release_store, git):
    s = release_store
    base = publish(s, "s", {"a": b"0"}, expected_parent=None)
    one = s.stage("s", {"a": b"1"}, expected_parent=base.release_id)
    two = s.stage("s", {"a": b"2"}, expected_parent=base.release_id)  # both saw the same head
    assert {r.release_id for r in s.staged("s")} == {one.release_id, two.release_id}
    assert s.advance("s", one.release_id, expected_head=base.release_id).current
    with pytest.raises(Conflict):  # update-ref <ref> <two> <base> fails: the ref is at <one>
        s.advance("s", two.release_id, expected_head=base.release_id)
    with pytest.raises(Conflict):  # and it cannot be grafted onto the new head either
        s.advance("s", two.release_id, expected_head=one.release_id)
    assert s.discard(two.release_id) and not s.discard(two.release_id)
    with pytest.raises(NotFound):  # a discarded stage is not a release
        s.get(two.release_id)
    assert s.advance("s", one.release_id, expected_head=base.release_id).current  # idempotent retry
    reflog = git("reflog", "show", "--format=%H", scenario_ref("s"), cwd=s.git_dir).split()
    assert reflog == [one.release_id, base.release_id]  # the bare repo keeps a reflog for refs/reef
