"""The release store writes git and git-lfs objects itself: git and git-lfs must read them as their own."""

from __future__ import annotations

import os
import subprocess

import pytest

from reef_core.commit.release import scenario_ref
from reef_core.errors import Conflict
from reef_core.testing.chain import publish


def test_objects_pass_fsck_and_pointers_match_git_lfs(release_store, tmp_path, git):
    s = release_store
    weights = os.urandom(300_000)
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(200_000))
    files = {"model.safetensors": weights, "sub/dir/w.bin": src, "config.json": b"{}", "sub/a.txt": b"a",
             "sub.txt": b"sorts between 'sub' and 'sub/'", "empty.pt": b""}
    first = publish(s, "s", files, expected_parent=None)
    second = publish(s, "s", {**files, "config.json": b'{"v": 2}'}, expected_parent=first.release_id)

    git("fsck", "--strict", "--no-dangling", cwd=s.git_dir)
    git("lfs", "fsck", scenario_ref("s"), cwd=s.git_dir)
    # The committed pointer is byte-identical to what git-lfs's clean filter prints for the same bytes.
    clean = subprocess.run(["git", "lfs", "clean", "--", "model.safetensors"], input=weights, cwd=s.git_dir,
                           capture_output=True, check=True).stdout
    assert git("cat-file", "blob", f"{second.release_id}:model.safetensors", cwd=s.git_dir).encode() == clean
    assert git("cat-file", "-p", f"{second.release_id}^", cwd=s.git_dir).startswith("tree ")
    # Unchanged weights are content-addressed: the same LFS object, written once.
    assert second.files["model.safetensors"] == first.files["model.safetensors"]
    assert sum(1 for _ in s.media_dir.glob("??/??/*")) == 2
    assert s.read_files(second.release_id) == {**{k: v for k, v in files.items() if k != "sub/dir/w.bin"},
                                               "sub/dir/w.bin": src.read_bytes(), "config.json": b'{"v": 2}'}
    assert not list(s.git_dir.glob("objects/??/tmp_obj_*")) and not list((s.media_dir.parent / "tmp").iterdir())


def test_a_lost_compare_and_swap_leaves_the_ref_session_usable(release_store):
    s = release_store
    first = publish(s, "s", {"a.txt": b"1"}, expected_parent=None)
    a = s.stage("s", {"a.txt": b"2"}, expected_parent=first.release_id)
    b = s.stage("s", {"a.txt": b"3"}, expected_parent=first.release_id)
    s.advance("s", a.release_id, expected_head=first.release_id)
    with pytest.raises(Conflict):  # git refuses the update (the head moved) and its update-ref session ends
        s.advance("s", b.release_id, expected_head=first.release_id)
    assert s.discard(b.release_id)
    third = publish(s, "s", {"a.txt": b"4"}, expected_parent=a.release_id)
    assert s.head("s").release_id == third.release_id
    assert [r.release_id for r in s.releases("s")] == [third.release_id, a.release_id, first.release_id]
