"""Record retention passes: ``storage.retention`` turned into compaction plans, run by ``reef gc --records`` and, every
``interval_s``, by a background thread of the process that runs the learners.

The eligibility rule and the crash safety are :mod:`reef_core.observe.compaction`'s; this module picks each
scenario's policy (:func:`~reef_core.config.record_retention.scenario_retention`), adds what the live processors hold,
bounds a background pass to ``max_records_per_pass`` and keeps the counts status and ``/metrics`` show.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from ..commit.crashpoints import crash_point
from ..config.record_retention import scenario_retention
from ..observe.compaction import (CompactionPolicy, CompactionResult, compaction_counts, plan_compaction,
                                  run_compaction)
from ..observe.records import RecordStore

log = logging.getLogger("reef.retention")

#: Crash points (``REEF_CRASH_AT``): inside a chunk's transaction before it commits, and after it committed.
CRASH_IN_CHUNK = "in_compaction_chunk"
CRASH_AFTER_CHUNK = "after_compaction_chunk"


def policies(section, scenarios: Iterable[str]) -> dict[str, CompactionPolicy]:
    """Each scenario's :class:`CompactionPolicy` under the ``storage.retention`` section."""
    out = {}
    for name in scenarios:
        found = scenario_retention(section, name)
        out[name] = CompactionPolicy(max_age_s=found.max_age_s, max_bytes=found.max_bytes,
                                     keep_scored=found.keep_scored)
    return out


def retention_pass(store: RecordStore, section, scenarios: Iterable[str], *, dry_run: bool = False,
                   protected: Callable[[str], Iterable[str]] | None = None, limit: int | None = None,
                   advance: Callable[[int], None] | None = None) -> dict:
    """Plan and run one pass over ``scenarios``; the report ``reef gc --records`` prints (counts by scenario and
    reason, body bytes before and after)."""
    chosen = policies(section, scenarios)
    plan = plan_compaction(store, chosen, total_max_bytes=section.max_bytes, protected=protected, limit=limit)

    def after_chunk(done: int) -> None:
        crash_point(CRASH_AFTER_CHUNK)
        if advance is not None:
            advance(done)

    result = run_compaction(store, plan, chunk_records=int(section.chunk_records), dry_run=dry_run,
                            protected=protected, in_chunk=lambda: crash_point(CRASH_IN_CHUNK),
                            after_chunk=after_chunk)
    return report(result, plan.body_bytes, plan.deferred, dry_run=dry_run, policies=chosen)


def report(result: CompactionResult, body_bytes: dict[str, int], deferred: int, *, dry_run: bool,
           policies: dict[str, CompactionPolicy]) -> dict:
    before = sum(body_bytes.values())
    freed = result.total("bytes_before") - result.total("bytes_after")
    return {
        "dry_run": dry_run,
        "scenarios": {name: {"policy": {"max_age_s": p.max_age_s, "max_bytes": p.max_bytes,
                                        "keep_scored": p.keep_scored},
                             "body_bytes_before": body_bytes.get(name, 0),
                             "compacted" if not dry_run else "would_compact": result.counts.get(name, {})}
                      for name, p in sorted(policies.items())},
        "records": result.total(),
        "skipped": result.skipped,
        "deferred": deferred,
        "body_bytes_before": before,
        "body_bytes_after": before - freed,
    }


class RetentionWorker:
    """The background pass of a deployment: every ``interval_s`` (0: never) a bounded pass over the scenarios
    whose learners run in this process, on its own thread (never the request path: each chunk queues on the
    record writer like any append). Keeps the store's compaction counts for status and ``/metrics``."""

    def __init__(self, store: RecordStore, section, scenarios: Callable[[], Iterable[str]],
                 protected: Callable[[str], Iterable[str]]):
        self.store = store
        self.section = section
        self._scenarios = scenarios
        self._protected = protected
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._counts: dict = {}
        self.passes = 0
        self.last_error: str | None = None
        self.last_pass: dict | None = None

    def counts(self) -> dict:
        """Records compacted per scenario and reason (read at start-up and after each pass)."""
        with self._lock:
            return {s: {r: dict(v) for r, v in reasons.items()} for s, reasons in self._counts.items()}

    def refresh(self) -> None:
        try:
            found = compaction_counts(self.store)
        except Exception:  # noqa: BLE001 - status must not fail because a count could not be read
            log.warning("could not read the record compaction counts", exc_info=True)
            return
        with self._lock:
            self._counts = found

    def start(self) -> None:
        self.refresh()
        interval = float(self.section.interval_s)
        if interval <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, args=(interval,), name="reef-record-retention",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def run_once(self) -> dict:
        """One bounded pass now (what the thread runs every ``interval_s``)."""
        try:
            found = retention_pass(self.store, self.section, list(self._scenarios()), protected=self._protected,
                                   limit=int(self.section.max_records_per_pass))
        except Exception as exc:  # noqa: BLE001 - the next pass tries again; serving goes on
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.warning("record retention pass failed: %s", self.last_error, exc_info=True)
            raise
        finally:
            self.refresh()
        self.passes += 1
        self.last_error = None
        self.last_pass = {k: found[k] for k in ("records", "skipped", "deferred", "body_bytes_before",
                                                 "body_bytes_after")}
        if found["records"]:
            log.info("record retention compacted %d record bodies (%d left for the next pass)", found["records"],
                     found["deferred"])
        return found

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.run_once()
            except Exception:  # noqa: BLE001 - logged in run_once
                pass

    def status(self) -> dict:
        return {"interval_s": float(self.section.interval_s), "passes": self.passes, "last_pass": self.last_pass,
                "last_error": self.last_error, "compacted": self.counts()}
