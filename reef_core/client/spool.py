"""The wrapper's per-user pending receipts: captured by the proxy, sent by ``reef-<adapter> report``.

One JSON file per scenario under ``$REEF_STATE_DIR`` (default ``${XDG_STATE_HOME:-~/.local/state}/reef``),
``pending/<scenario digest>.json``, holding ``{"scenario", "receipts": [{record_id, release_id, at}, ...]}``. Every
change rewrites it through a temporary file and a rename under an exclusive ``flock`` (several agent runs may spool
at once); a report claims the file by renaming it, so receipts captured meanwhile start a new one, and a report that
fails puts its receipts back.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import time
import uuid
from pathlib import Path


def state_dir() -> Path:
    explicit = os.environ.get("REEF_STATE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "reef"


class Spool:
    """The pending receipts of ``scenario`` for this user."""

    def __init__(self, scenario: str, root: Path | None = None):
        self.scenario = scenario
        digest = hashlib.sha256(scenario.encode("utf-8")).hexdigest()[:24]
        self.dir = (root or state_dir()) / "pending"
        self.path = self.dir / f"{digest}.json"
        self._lock_path = self.dir / f"{digest}.lock"

    @contextlib.contextmanager
    def _locked(self):
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self._lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self, path: Path) -> list[dict]:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return []
        return [r for r in data.get("receipts") or () if isinstance(r, dict) and isinstance(r.get("record_id"), str)]

    def _write(self, receipts: list[dict]) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".pending-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump({"scenario": self.scenario, "receipts": receipts}, out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def add(self, record_id: str, release_id: str | None = None) -> None:
        with self._locked():
            receipts = self._read(self.path)
            if all(r["record_id"] != record_id for r in receipts):
                receipts.append({"record_id": record_id, "release_id": release_id, "at": time.time()})
                self._write(receipts)

    def pending(self) -> list[dict]:
        with self._locked():
            return self._read(self.path)

    @contextlib.contextmanager
    def claim(self):
        """Yield the pending receipts, taken out of the spool; put back (before newer ones) if the body raises."""
        with self._locked():
            claimed = self.dir / f"{self.path.stem}.claimed-{uuid.uuid4().hex}"
            try:
                os.rename(self.path, claimed)
            except FileNotFoundError:
                claimed = None
        receipts = self._read(claimed) if claimed else []
        try:
            yield receipts
        except BaseException:
            with self._locked():
                newer = self._read(self.path)
                seen = {r["record_id"] for r in receipts}
                self._write(receipts + [r for r in newer if r["record_id"] not in seen])
            raise
        finally:
            if claimed:
                claimed.unlink(missing_ok=True)
