"""Per-scenario append-only commit log (JSONL); the fsynced append is the commit point.

Row: ``{step, operation, release_id, consumed_ids, algorithm_state, metrics, evaluation,
decision, recorded_at}`` plus optional extra keys (e.g. ``pending`` for a review-held
release). Steps start at 1 and grow by one.

* ``append(row, expected_step)`` is a compare-and-swap on the step: the new row gets
  ``expected_step + 1`` and ``expected_step`` must be the last step. Retrying a row that is
  already stored at that step (same content, ``recorded_at`` aside) returns the stored row;
  anything else is a Conflict.
* A crash mid-append can leave a torn last line. Readers ignore it; the next writer truncates
  it when opening. A damaged line anywhere else is corruption (StorageUnavailable).
* One writer per scenario: the writer holds ``fcntl.flock(LOCK_EX | LOCK_NB)`` on
  ``<log>.lock`` for as long as it is open; a second writer (another process, or another open
  in this one) fails at once with :class:`LogLocked`. Readers take no lock.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path

from reef_core.commit.release import scenario_key
from reef_core.errors import Conflict, StorageUnavailable, ValidationFailed

_KNOWN = ("operation", "release_id", "consumed_ids", "algorithm_state", "metrics", "evaluation", "decision")
_VOLATILE = ("step", "recorded_at")


class LogLocked(Conflict):
    """Another writer holds the scenario's commit log."""

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


class CommitLog:
    """The commit log of one scenario. ``writer=True`` takes the single-writer lock."""

    def __init__(self, path: str | os.PathLike, *, writer: bool = True):
        self.path = Path(path)
        self.writer = writer
        self._lock_fd: int | None = None
        self._fd: int | None = None
        self._rows: list[dict] = []
        self._stamp: tuple[int, int] | None = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if writer:
            self._acquire()
            try:
                self._open_for_append()
            except BaseException:
                self.close()
                raise
        else:
            self._refresh()

    @classmethod
    def for_scenario(cls, root: str | os.PathLike, scenario: str, *, writer: bool = True) -> "CommitLog":
        """The log of ``scenario`` under ``root`` (file name: urlsafe-base64 of the name)."""
        return cls(Path(root) / f"{scenario_key(scenario)}.jsonl", writer=writer)

    # ---------------------------------------------------------------- lifecycle

    def _acquire(self) -> None:
        lock_path = self.path.with_name(self.path.name + ".lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LogLocked(
                f"commit log {self.path} already has a writer (pid {holder}); only one process may "
                "write a scenario's log: stop the other Reef server or point it at another data dir",
                path=str(self.path),
                holder=holder,
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _open_for_append(self) -> None:
        created = not self.path.exists()
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        if created:
            _fsync_dir(self.path.parent)
        data = _read_all(self._fd)
        self._rows, valid = _parse(data, self.path)
        if valid < len(data):  # drop the torn tail left by a crash before appending after it
            os.ftruncate(self._fd, valid)
            os.fsync(self._fd)

    def close(self) -> None:
        for attr in ("_fd", "_lock_fd"):
            fd = getattr(self, attr)
            if fd is not None:
                os.close(fd)  # closing the lock descriptor releases the flock
                setattr(self, attr, None)

    def __enter__(self) -> "CommitLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # pragma: no cover - safety net
        try:
            self.close()
        except Exception:
            pass

    # ---------------------------------------------------------------- reading

    def _refresh(self) -> None:
        """Readers re-read the file when it changed; the writer's memory is authoritative."""
        if self.writer:
            return
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._rows, self._stamp = [], None
            return
        stamp = (st.st_size, st.st_mtime_ns)
        if stamp != self._stamp:
            self._rows, _ = _parse(self.path.read_bytes(), self.path)
            self._stamp = stamp

    def last_step(self) -> int:
        """The step of the last committed row (0 for an empty log)."""
        self._refresh()
        return len(self._rows)

    def last_row(self) -> dict | None:
        self._refresh()
        return dict(self._rows[-1]) if self._rows else None

    def row(self, step: int) -> dict:
        self._refresh()
        if not 1 <= step <= len(self._rows):
            raise ValidationFailed(f"no commit-log row at step {step}")
        return dict(self._rows[step - 1])

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
        if not self.writer or self._fd is None:
            raise ValidationFailed(f"commit log {self.path} is not open for writing")
        normalized = normalize_row(row)
        if "step" in row and row["step"] != expected_step + 1:
            raise ValidationFailed(f"row step {row['step']} does not follow expected step {expected_step}")
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
        size = os.fstat(self._fd).st_size
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(self._fd, view) :]
            os.fsync(self._fd)
        except OSError as exc:
            # Undo a partial line so the log stays parseable; the row is not committed.
            try:
                os.ftruncate(self._fd, size)
            except OSError:
                pass
            raise StorageUnavailable(f"commit log append failed: {exc}") from exc
        self._rows.append(stored)
        return dict(stored)


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
