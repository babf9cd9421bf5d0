"""Per-scenario append-only commit log (JSONL); the fsynced append is the commit point.

Row: ``{step, operation, release_id, consumed_ids, algorithm_state, metrics, evaluation,
decision, recorded_at}`` plus optional extra keys (e.g. ``pending`` for a review-held
release). Steps start at 1 and grow by one.

* ``append(row, expected_step)`` is a compare-and-swap on the step: the new row gets
  ``expected_step + 1`` and ``expected_step`` must be the last step. Retrying a row that is
  already stored at that step (same content, ``recorded_at`` aside) returns the stored row;
  anything else is a Conflict.
* A crash mid-append can leave a torn last line. Readers ignore it; the next append truncates
  it first. A damaged line anywhere else is corruption (StorageUnavailable).
* No descriptor stays open between calls (a deployment holds one log per scenario, most of
  them idle): an append opens the file, takes ``fcntl.flock(LOCK_EX)`` on it, re-reads what
  other writers added since this object last looked, checks the step, writes, fsyncs and
  closes. Writers in any process are thus serialised per write and the CAS sees every row.
* One process per data directory: :class:`WriterLock` (held by the deployment while it
  serves) makes a second server on the same commit directory fail at once with
  :class:`LogLocked`, naming the holder's pid. Readers take no lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from collections.abc import Iterable
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from reef_core.commit.release import scenario_path
from reef_core.errors import Conflict, StorageUnavailable, ValidationFailed

_KNOWN = ("operation", "release_id", "consumed_ids", "algorithm_state", "metrics", "evaluation", "decision")
_VOLATILE = ("step", "recorded_at")


class LogLocked(Conflict):
    """Another process writes this data directory's commit logs."""

    code = "log_locked"


def _json(value, what: str):
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    try:
        return json.loads(json.dumps(value, sort_keys=True))
    except (TypeError, ValueError) as exc:
        raise ValidationFailed(f"commit-log {what} must be JSON-serialisable: {exc}") from exc


def normalize_row(row: dict) -> dict:
    """Validate a row to append and give it its canonical JSON form (without step/time)."""
    if not isinstance(row, dict):
        raise ValidationFailed("a commit-log row must be a dict")
    op = row.get("operation")
    if not isinstance(op, str) or not op:
        raise ValidationFailed("a commit-log row needs an 'operation' string")
    rid = row.get("release_id")
    if rid is not None and not isinstance(rid, str):
        raise ValidationFailed("release_id must be a string or null")
    consumed = row.get("consumed_ids") or []
    if isinstance(consumed, (str, bytes)) or not all(isinstance(c, str) for c in consumed):
        raise ValidationFailed("consumed_ids must be a list of strings")
    out = {k: _json(v, k) for k, v in row.items() if k not in _KNOWN and k not in _VOLATILE}
    out.update(
        operation=op,
        release_id=rid,
        consumed_ids=list(dict.fromkeys(consumed)),
        algorithm_state=_json(row.get("algorithm_state"), "algorithm_state"),
        metrics=_json(row.get("metrics") or {}, "metrics"),
        evaluation=_json(row.get("evaluation"), "evaluation"),
        decision=_json(row.get("decision"), "decision"),
    )
    return out


def _same(stored: dict, normalized: dict) -> bool:
    return {k: v for k, v in stored.items() if k not in _VOLATILE} == normalized


def _parse(data: bytes, path: Path) -> tuple[list[dict], int]:
    """Rows and the byte length of the valid prefix; a torn or garbled final line is dropped."""
    rows: list[dict] = []
    pos = 0
    while pos < len(data):
        eol = data.find(b"\n", pos)
        if eol < 0:
            break  # torn: the final write never completed its newline
        try:
            row = json.loads(data[pos:eol])
            if not isinstance(row, dict) or row.get("step") != len(rows) + 1:
                raise ValueError(f"expected step {len(rows) + 1}")
        except ValueError as exc:
            if data[eol + 1 :].strip(b"\0\n") == b"":
                break  # garbage in the last line only: the torn tail of a crashed append
            raise StorageUnavailable(f"commit log {path} is corrupt at byte {pos}: {exc}") from exc
        rows.append(row)
        pos = eol + 1
    return rows, pos


class WriterLock:
    """The one-process-per-directory lock: ``flock`` on ``<directory>/.writer.lock``, held until released.

    A second holder (another process, or another ``WriterLock`` in this one) fails at once with
    :class:`LogLocked`. The lock file records the holder's pid for that message.
    """

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory) / ".writer.lock"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LogLocked(
                f"commit logs in {self.path.parent} already have a writer (pid {holder}); only one process may "
                "write a data directory's commit logs: stop the other Reef server or point it at another data dir",
                path=str(self.path.parent),
                holder=holder,
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __enter__(self) -> "WriterLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):  # pragma: no cover - safety net
        try:
            self.release()
        except Exception:
            pass


class CommitLog:
    """The commit log of one scenario; ``writer=False`` refuses appends (a read-only view).

    Rows are cached in memory and re-read when the file changes (its inode, size or mtime), so
    reads cost a ``stat`` and no descriptor is held between calls.
    """

    def __init__(self, path: str | os.PathLike, *, writer: bool = True):
        self.path = Path(path)
        self.writer = writer
        self._rows: list[dict] = []
        self._stamp: tuple[int, int, int] | None = None
        self._mutex = threading.Lock()  # the learner writes while status routes read
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if writer:
            with self._open_locked():  # validates the log and drops a torn tail now, not at the first step
                pass
        else:
            self._refresh()

    @classmethod
    def for_scenario(cls, root: str | os.PathLike, scenario: str, *, writer: bool = True) -> "CommitLog":
        """The log of ``scenario`` under ``root`` (file name: the name's digest, see ``scenario_path``)."""
        return cls(scenario_path(root, scenario, ".jsonl"), writer=writer)

    # ---------------------------------------------------------------- lifecycle

    @contextmanager
    def _open_locked(self):
        """The log opened for appending under an exclusive flock, with rows and stamp brought up to date."""
        created = not self.path.exists()
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for one write; another writer waits that long at most
            if created:
                _fsync_dir(self.path.parent)
            with self._mutex:  # held through the write: readers of this object wait for the fsync
                st = os.fstat(fd)
                if _stamp(st) != self._stamp:
                    data = _read_all(fd)
                    self._rows, valid = _parse(data, self.path)
                    if valid < len(data):  # drop the torn tail left by a crash before appending after it
                        os.ftruncate(fd, valid)
                        os.fsync(fd)
                    self._stamp = _stamp(os.fstat(fd))
                yield fd
        finally:
            os.close(fd)  # also releases the flock

    def close(self) -> None:
        """Nothing is held between calls; kept so callers may scope a log with ``with``."""

    def __enter__(self) -> "CommitLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- reading

    def _refresh(self) -> None:
        """Re-read the file when it changed since this object last looked."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            with self._mutex:
                self._rows, self._stamp = [], None
            return
        with self._mutex:
            if _stamp(st) != self._stamp:
                self._rows, _ = _parse(self.path.read_bytes(), self.path)
                self._stamp = _stamp(st)

    def last_step(self) -> int:
        """The step of the last committed row (0 for an empty log)."""
        self._refresh()
        return len(self._rows)

    def last_row(self) -> dict | None:
        self._refresh()
        rows = self._rows
        return dict(rows[-1]) if rows else None

    def row(self, step: int) -> dict:
        self._refresh()
        rows = self._rows
        if not 1 <= step <= len(rows):
            raise ValidationFailed(f"no commit-log row at step {step}")
        return dict(rows[step - 1])

    def rows(
        self, after_step: int = 0, limit: int = 50, record_id: str | Iterable[str] | None = None
    ) -> list[dict]:
        """Rows with ``step > after_step``, oldest first, at most ``limit``.

        ``record_id`` (one id or several) keeps rows whose ``consumed_ids`` name one of them.
        """
        if limit < 1:
            raise ValidationFailed("limit must be at least 1")
        self._refresh()
        wanted = None
        if record_id is not None:
            wanted = {record_id} if isinstance(record_id, str) else set(record_id)
        out = []
        for row in self._rows[max(after_step, 0) :]:
            if wanted is not None and not wanted.intersection(row.get("consumed_ids") or ()):
                continue
            out.append(dict(row))
            if len(out) == limit:
                break
        return out

    def consumed_ids(self) -> set[str]:
        """Every record id consumed by any committed row."""
        self._refresh()
        return {rid for row in self._rows for rid in row.get("consumed_ids") or ()}

    # ---------------------------------------------------------------- writing

    def append(self, row: dict, expected_step: int) -> dict:
        """Commit ``row`` as step ``expected_step + 1`` (CAS); return the stored row."""
        if not self.writer:
            raise ValidationFailed(f"commit log {self.path} is not open for writing")
        normalized = normalize_row(row)
        if "step" in row and row["step"] != expected_step + 1:
            raise ValidationFailed(f"row step {row['step']} does not follow expected step {expected_step}")
        with self._open_locked() as fd:
            last = len(self._rows)
            if expected_step != last:
                if 0 <= expected_step < last and _same(self._rows[expected_step], normalized):
                    return dict(self._rows[expected_step])  # identical retry of a committed row
                raise Conflict(
                    f"commit log {self.path.name} is at step {last}, expected {expected_step}",
                    expected_step=expected_step,
                    last_step=last,
                )
            stored = {
                "step": last + 1,
                **normalized,
                "recorded_at": datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z"),
            }
            line = (json.dumps(stored, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n").encode()
            size = os.fstat(fd).st_size
            try:
                view = memoryview(line)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            except OSError as exc:
                # Undo a partial line so the log stays parseable; the row is not committed.
                try:
                    os.ftruncate(fd, size)
                except OSError:
                    pass
                raise StorageUnavailable(f"commit log append failed: {exc}") from exc
            self._rows = [*self._rows, stored]  # under the mutex; a new list, so callers' copies stay valid
            self._stamp = _stamp(os.fstat(fd))
            return dict(stored)


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _read_all(fd: int) -> bytes:
    chunks, offset = [], 0
    while True:
        chunk = os.pread(fd, 1 << 20, offset)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        offset += len(chunk)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
