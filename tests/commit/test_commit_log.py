"""The per-scenario JSONL commit log: step CAS, identical retry, torn tail, single writer."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reef_core.commit.commitlog import CommitLog, LogLocked, WriterLock
from reef_core.errors import Conflict, StorageUnavailable, ValidationFailed

ROOT = Path(__file__).resolve().parents[2]


def row(op="training", release="a" * 40, ids=("r1",), **extra):
    return {"operation": op, "release_id": release, "consumed_ids": list(ids), "metrics": {"loss": 1.0}, **extra}


def test_append_is_a_step_cas_with_identical_retry(tmp_path):
    with CommitLog.for_scenario(tmp_path, "agent/x") as log:
        assert log.last_step() == 0 and log.rows() == []
        first = log.append(row(ids=["r1", "r2"]), expected_step=0)
        assert first["step"] == 1 and first["consumed_ids"] == ["r1", "r2"]
        assert {"recorded_at", "algorithm_state", "evaluation", "decision"} <= first.keys()
        second = log.append(row(release="b" * 40, ids=["r3"]), expected_step=1)
        assert second["step"] == 2
        # Identical retry of step 1 returns the stored row, recorded_at included; nothing appended.
        assert log.append(row(ids=["r1", "r2"]), expected_step=0) == first
        assert log.last_step() == 2
        with pytest.raises(Conflict):  # same step, different content
            log.append(row(ids=["other"]), expected_step=0)
        with pytest.raises(Conflict):  # stale for a new row
            log.append(row(ids=["r9"]), expected_step=1)
        with pytest.raises(Conflict):  # from the future
            log.append(row(ids=["r9"]), expected_step=5)
        with pytest.raises(ValidationFailed):
            log.append({"release_id": None}, expected_step=2)
        with pytest.raises(ValidationFailed):
            log.append({"operation": "training", "consumed_ids": "r1"}, expected_step=2)  # not a list
    lines = (tmp_path / f"{hashlib.sha256(b'agent/x').hexdigest()}.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]


def test_rows_paging_filter_and_consumed_ids(tmp_path):
    with CommitLog(tmp_path / "s.jsonl") as log:
        for step, ids in enumerate([["a", "b"], [], ["c"], ["b", "d"]]):
            log.append(row(ids=ids, release=None), step)
        assert [r["step"] for r in log.rows(after_step=1, limit=2)] == [2, 3]
        assert [r["step"] for r in log.rows(record_id="b")] == [1, 4]
        assert [r["step"] for r in log.rows(record_id=["c", "d"], limit=1)] == [3]
        assert log.consumed_ids() == {"a", "b", "c", "d"}
        # A reader in parallel (no lock) sees the writer's committed rows.
        reader = CommitLog(tmp_path / "s.jsonl", writer=False)
        assert reader.last_step() == 4
        log.append(row(ids=["e"]), 4)
        assert reader.last_step() == 5 and "e" in reader.consumed_ids()


def test_torn_last_line_is_ignored_then_truncated(tmp_path):
    path = tmp_path / "s.jsonl"
    with CommitLog(path) as log:
        log.append(row(ids=["r1"]), 0)
        log.append(row(ids=["r2"]), 1)
    good = path.stat().st_size
    with open(path, "ab") as fh:  # a crash mid-append: half a line, no newline
        fh.write(b'{"step":3,"operation":"training","consumed_')
    reader = CommitLog(path, writer=False)
    assert reader.last_step() == 2 and reader.consumed_ids() == {"r1", "r2"}
    with CommitLog(path) as log:  # the next writer truncates the torn tail
        assert path.stat().st_size == good
        assert log.append(row(ids=["r3"]), 2)["step"] == 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


def test_damage_before_the_last_line_is_corruption(tmp_path):
    path = tmp_path / "s.jsonl"
    with CommitLog(path) as log:
        for step in range(3):
            log.append(row(ids=[f"r{step}"]), step)
    lines = path.read_bytes().split(b"\n")
    lines[1] = b"{not json"
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(StorageUnavailable, match="corrupt"):
        CommitLog(path)


def test_one_process_per_commit_directory(tmp_path):
    first = WriterLock(tmp_path)
    with pytest.raises(LogLocked, match="already have a writer"):
        WriterLock(tmp_path)  # a second holder in the same process is refused too
    script = (
        "import sys\n"
        "from reef_core.commit.commitlog import WriterLock, LogLocked\n"
        "try:\n"
        "    WriterLock(sys.argv[1])\n"
        "except LogLocked as exc:\n"
        "    print(exc); sys.exit(3)\n"
        "print('acquired')\n"
    )
    other = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert other.returncode == 3, other.stderr
    assert "already have a writer" in other.stdout and "pid" in other.stdout
    first.release()
    again = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert again.returncode == 0 and "acquired" in again.stdout


def _open_paths(directory: Path) -> list[str]:
    found = []
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(directory)):
            found.append(target)
    return found


def test_an_idle_log_holds_no_descriptor(tmp_path):
    logs = [CommitLog.for_scenario(tmp_path, f"s{i}") for i in range(20)]
    for i, log in enumerate(logs):
        log.append(row(ids=[f"r{i}"]), 0)
        assert log.last_step() == 1
    assert _open_paths(tmp_path) == []


def test_two_writers_are_serialised_by_the_step_cas(tmp_path):
    path = tmp_path / "s.jsonl"
    a, b = CommitLog(path), CommitLog(path)
    a.append(row(ids=["r1"]), 0)
    # b has not read since a wrote: its append re-reads under the lock, so the CAS sees a's row.
    with pytest.raises(Conflict, match="at step 1, expected 0"):
        b.append(row(ids=["other"]), 0)
    assert b.append(row(ids=["r1"]), 0)["step"] == 1  # a's row, retried identically, is the stored one
    assert b.append(row(ids=["r2"]), 1)["step"] == 2
    assert a.last_step() == 2 and a.last_row()["consumed_ids"] == ["r2"]
    with pytest.raises(Conflict):
        a.append(row(ids=["r3"]), 1)
