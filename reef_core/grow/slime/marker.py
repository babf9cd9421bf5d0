"""The durable job marker: one JSON file per slime job, rewritten atomically at every phase.

Phases, in order (who writes each):

``RUNNING`` (Reef, before launching the job) -> ``CHECKPOINT`` (the driver, once the HF checkpoint and its
manifest are on disk) -> ``UPDATING_WEIGHTS`` (Reef, reading the checkpoint into the candidate's weights) ->
``READY_TO_COMMIT`` (Reef, candidate handed to the learner's gate and commit) -> ``HEAD_COMMITTED`` (Reef, the
release is the scenario's head) -> ``COMPLETE`` (Reef, job inputs and checkpoint removed). Side exits:
``REJECTED`` (the gate refused the candidate, or its step was decided without it) and ``ABANDONED`` (an ambiguous
``RUNNING`` job, fenced off). What recovery does in each phase is in :mod:`reef_core.grow.slime.trainer`.

Every write goes to a temporary file that is fsynced, renamed over the marker and followed by an fsync of the
directory, so a crash leaves either the old phase or the new one, never a torn file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

MARKER = "marker.json"

RUNNING = "RUNNING"
CHECKPOINT = "CHECKPOINT"
UPDATING_WEIGHTS = "UPDATING_WEIGHTS"
READY_TO_COMMIT = "READY_TO_COMMIT"
HEAD_COMMITTED = "HEAD_COMMITTED"
COMPLETE = "COMPLETE"
REJECTED = "REJECTED"
ABANDONED = "ABANDONED"

PHASES = (RUNNING, CHECKPOINT, UPDATING_WEIGHTS, READY_TO_COMMIT, HEAD_COMMITTED, COMPLETE, REJECTED, ABANDONED)
#: Phases after which nothing is left to do for the job.
FINAL = frozenset({COMPLETE, REJECTED, ABANDONED})


def fsync_dir(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old content or the new, durably."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_marker(job_dir: Path) -> dict[str, Any] | None:
    """The job's marker, or None when the job has none (its directory was never completed)."""
    try:
        marker = json.loads((Path(job_dir) / MARKER).read_text())
    except FileNotFoundError:
        return None
    if marker.get("phase") not in PHASES:
        raise ValueError(f"{job_dir}/{MARKER}: unknown phase {marker.get('phase')!r}")
    return marker


def write_marker(job_dir: Path, phase: str, **fields: Any) -> dict[str, Any]:
    """Move the job to ``phase``, keeping the fields of the previous marker (``fields`` win)."""
    if phase not in PHASES:
        raise ValueError(f"unknown job phase {phase!r}")
    marker = dict(read_marker(job_dir) or {})
    history = list(marker.get("history", []))
    history.append(phase)
    marker.update(fields, phase=phase, history=history, updated_at=time.time())
    write_atomic(Path(job_dir) / MARKER, json.dumps(marker, sort_keys=True).encode())
    return marker
