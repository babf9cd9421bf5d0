"""`reef gc` over a real deployment data directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from reef_core.commit.git_store import GitArtifactStore
from reef_core.testing.chain import publish


def reef_gc(data_dir, *args, stderr=None):
    result = subprocess.run([sys.executable, "-m", "reef_core.cli", "gc", *args, f"storage.data_dir={data_dir}"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    if stderr is not None:
        stderr.append(result.stderr)
    return json.loads(result.stdout)


def test_gc_dry_run_then_prune(tmp_path):
    store = GitArtifactStore(tmp_path / "artifacts.git", tmp_path / "artifacts-work")
    head = publish(store, "s", {"model.safetensors": os.urandom(4096)}, expected_parent=None)
    held = [publish(store, "s", {"model.safetensors": os.urandom(4096)}, expected_parent=head.release_id, hold=True)
            for _ in range(3)]
    head = publish(store, "s", {"model.safetensors": os.urandom(4096)}, expected_parent=head.release_id)

    plan = reef_gc(tmp_path, "--dry-run", "storage.retention.keep_last=2")
    assert plan["dry_run"] is True
    doomed = set(plan["would_prune_releases"])
    assert head.release_id not in doomed
    assert doomed == {held[0].release_id, held[1].release_id}  # older held releases beyond keep_last
    assert plan["reclaimed_bytes"] >= 2 * 4096
    # A dry run changes nothing.
    assert all(r.restorable for r in store.releases("s"))

    pinned = reef_gc(tmp_path, "--dry-run", "storage.retention.keep_last=2",
                     f"storage.retention.pinned=[{held[0].release_id}]")
    assert set(pinned["would_prune_releases"]) == {held[1].release_id}

    err: list[str] = []
    done = reef_gc(tmp_path, "storage.retention.keep_last=2", stderr=err)
    assert set(done["pruned_releases"]) == doomed
    n = len(done["deleted_objects"])
    assert n >= 2 and f"reef gc: deleting LFS objects: {n}/{n} objects" in err[0]
    rows = {r.release_id: r for r in GitArtifactStore(tmp_path / "artifacts.git", tmp_path / "artifacts-work")
            .releases("s")}
    assert not rows[held[0].release_id].restorable and rows[head.release_id].restorable
    assert rows[head.release_id].current
