"""Computed feedback from the next state (OpenClaw-RL style): every turn is judged by what came after it.

For scenarios without reports. Each complete chat inference is a *turn*; the next request of the same conversation
delivers its *next state* (the user's next message, or the tool results), and a judge scores the pair.

Correlation (at ingest, cheap, no judge call):

* ``session`` tag (``x-reef-tag-session``, configurable with ``session_tag``): a request pairs with the previous turn
  of its session. A request with the same prompt as that turn is a retry: the earlier turn is retired
  (``retried``). A request that does not extend the turn's transcript and, unlike the turn, offers no tools is a
  side call (title, compaction): it is retired (``side_call``) and the turn keeps waiting.
* no tag: transcript matching. A request pairs with the open turn whose prompt + reply its messages start with
  (the longest such match), provided it adds at least one message after them. A request repeating an open turn's
  prompt exactly is a retry (``retried``).

A turn nothing followed within ``session_ttl_s`` seconds (of its ``created_at``) expires (``session_expired``): the
last turn of a session never trains. Turns already consumed (a replay after a restart) still correlate but are never
judged again.

Explicit reports win: a report (``POST /reef/report``) with a finite ``score`` quoting a turn's receipt scores that
turn instead of the judge, whether the turn still waits for its next state (it trains without one), waits for the
judge, or was judged and waits for a batch (its sample is replaced). The report's id is consumed with the turn. A
report quoting a turn already in a batch or trained is ``report_late``; one without a score, or quoting no turn this
processor holds, is counted in ``reports_ignored``.

Judging runs OFF the ingest path, lazily, on the thread that calls :meth:`ready` or :meth:`pending_batch` (the
learner's), without holding the processor lock, and only until ``batch_size`` judged samples wait. The judge is
``judge(turn_record, next_record)`` returning a float score, ``"wait"`` (ask again on a later call), ``"never"``
(drop: ``judge_never``), ``{"never": reason}`` (drop, counted under ``reason``, e.g. a judge's failed vote) or a dict
``{"score", "feedback"?, "metadata"?}``. A judge that raises is retried up to
``max_judge_attempts`` times (then ``judge_error``); anything else it returns is ``judge_invalid``. Without a judge
the processor only correlates (pairs wait; nothing trains), as upstream does with no reward model configured.

A sample is the turn's prompt + reply (``source_ids`` = the turn's receipt, which acknowledging consumes) with the
judge's score as reward; ``metadata["reef"]`` holds ``next_record_id``, ``next_state``, ``correlation`` and the
session.

Memory: a waiting turn is a :class:`Turn` of scalars and digests (id, sequence, version, created_at, session,
prompt/transcript hashes, whether it offered tools), never a body. When a pair is judged, the turn and its next
record are read back through ``load_records`` (the record store), off the lock; a pair one of whose records the
store no longer has is dropped (``record_gone``). Without ``load_records`` (offline use, tests) each turn keeps its
whole record instead.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from reef_core.observe.compacted import is_compacted
from reef_core.observe.model import Record
from reef_core.observe.processor import Judge, ServingVersion
from reef_core.observe.processors import eligibility as el
from reef_core.observe.processors.base import BufferedProcessor, Unit
from reef_core.observe.processors.conversation import UnusableRecord, common_prefix, exchange_of, prefix_hashes
from reef_core.observe.processors.per_report import RecordLoader
from reef_core.observe.processors.samples import trajectory_sample

log = logging.getLogger("reef.observe.processors")

RETRIED = "retried"
SIDE_CALL = "side_call"
SESSION_EXPIRED = "session_expired"
JUDGE_NEVER = "judge_never"
JUDGE_ERROR = "judge_error"
JUDGE_INVALID = "judge_invalid"
RECORD_GONE = "record_gone"  # the store no longer has the turn or its next record when the pair is judged
REPORT_LATE = "report_late"  # an explicit report quoting a turn already in a batch or trained

#: How soon a pair whose judge said ``wait`` (or failed) is asked again, when nothing else wakes the learner.
JUDGE_RETRY_S = 1.0


@dataclass(slots=True, eq=False)
class Turn:
    """What correlation needs of one turn: no payload (see the module docstring)."""

    record_id: str
    sequence: int | None
    version: str | None
    created_at: float
    session: str | None
    prompt_hash: str  # digest of the request's messages
    transcript_hash: str  # digest of messages + [reply]
    transcript_len: int  # len(messages) + 1
    has_tools: bool
    #: the whole record, only when there is no store to read it back from
    body: Record | None = None


@dataclass(slots=True, frozen=True)
class Report:
    """An explicit score for one turn: it wins over the judge."""

    report_id: str
    score: float
    feedback: object = None
    metadata: dict | None = None


@dataclass(slots=True, eq=False)
class Job:
    """A turn paired with the request that followed it (``next_turn``; None: scored by a report), waiting."""

    turn: Turn
    next_turn: Turn | None
    correlation: str
    #: whether the next request's messages start with the turn's whole transcript (else the shared prefix is
    #: measured when the bodies are read back)
    extends: bool
    attempts: int = 0
    waits: int = 0


def _offers_tools(record: Record) -> bool:
    request = record.payload.get("request")
    return isinstance(request, dict) and bool(request.get("tools"))


class NextStateProcessor(BufferedProcessor):
    """Pairs each turn with its next state and has a judge score it; see the module docstring.

    Args:
        scenario: the scenario whose records this processor sees.
        judge: ``judge(turn, next) -> float | "wait" | "never" | dict``; ``None`` correlates only.
        session_tag: the tag naming a conversation (``record.tags[session_tag]``).
        batch_size: judged samples per batch.
        session_ttl_s: seconds after which an unanswered turn expires (``None``: never).
        max_open_turns: cap on turns waiting for their next state (the oldest expire first).
        max_judge_attempts: calls of a raising judge per pair before it is dropped.
        load_records: reads the turn and next records back from the store when a pair is judged.
        max_staleness, serving_version, clock: as :class:`~.per_report.ReportedProcessor`.
    """

    name = "next_state"

    def __init__(self, scenario: str, *, judge: Judge | None = None, session_tag: str = "session",
                 batch_size: int = 1, session_ttl_s: float | None = 900.0, max_open_turns: int = 10_000,
                 max_judge_attempts: int = 3, max_staleness: int | None = None,
                 serving_version: ServingVersion | None = None, load_records: RecordLoader | None = None,
                 clock: Callable[[], float] = time.time):
        super().__init__(scenario, max_staleness=max_staleness, serving_version=serving_version, clock=clock)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError("batch_size must be a positive integer")
        if session_ttl_s is not None and not session_ttl_s > 0:
            raise ValueError("session_ttl_s must be positive (or null)")
        if max_open_turns < 1 or max_judge_attempts < 1:
            raise ValueError("max_open_turns and max_judge_attempts must be positive")
        if judge is not None and not callable(judge):
            raise ValueError("judge must be callable")
        self.judge = judge
        self.session_tag = session_tag.lower()
        self.batch_size = batch_size
        self.session_ttl_s = float(session_ttl_s) if session_ttl_s is not None else None
        self.max_open_turns = int(max_open_turns)
        self.max_judge_attempts = int(max_judge_attempts)
        self._load_records = load_records
        self._open: dict[str, Turn] = {}  # every turn waiting for its next state, oldest first
        self._sessions: dict[str, Turn] = {}  # tagged: the last turn of each session
        self._by_transcript: dict[str, Turn] = {}  # untagged: open turns by digest of prompt + reply
        self._by_prompt: dict[str, Turn] = {}  # untagged: open turns by digest of prompt (retry detection)
        self._jobs: deque[Job] = deque()
        self._judging = 0
        self._in_judge: set[str] = set()  # turns whose pair the judge is scoring now (lock released)
        self._reported: dict[str, Report] = {}  # turn id -> the report that wins over the judge
        self._units: deque[Unit] = deque()
        self._reports_ignored = 0
        self._pairs = {"tag": 0, "transcript": 0}

    # -- correlation (ingest path: cheap, no judge) -------------------------------------------------------------------

    def _ingest(self, record: Record) -> None:
        if record.kind != "inference":
            self._take_report(record)
            return
        self._refresh()  # a turn past its TTL expires before a late next state could pair with it
        why = el.unusable_reason(record)
        if why is not None:
            self._count_drop(why)
            return
        try:
            messages, reply = exchange_of(record)
        except UnusableRecord:
            self._count_drop(el.NOT_CHAT)
            return
        hashes = prefix_hashes(messages)
        transcript = prefix_hashes([*messages, reply])[-1]
        session = record.tags.get(self.session_tag)
        turn = Turn(record.record_id, record.sequence, record.version, record.created_at,
                    str(session) if session is not None else None, hashes[-1], transcript, len(messages) + 1,
                    _offers_tools(record), record if self._load_records is None else None)
        if turn.session is not None:
            if not self._follow_session(turn, hashes, len(messages)):
                return
            self._sessions[turn.session] = turn
        else:
            self._follow_transcript(turn, hashes)
            self._by_transcript[turn.transcript_hash] = turn
            self._by_prompt[turn.prompt_hash] = turn
        self._open[record.record_id] = turn
        while len(self._open) > self.max_open_turns:
            self._retire(next(iter(self._open.values())), SESSION_EXPIRED)

    def _take_report(self, record: Record) -> None:
        """An explicit score for the turns it quotes (see the module docstring)."""
        score = record.payload.get("score") if isinstance(record.payload, dict) else None
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score) \
                or not record.references:
            self._reports_ignored += 1
            return
        metadata = record.payload.get("metadata")
        report = Report(record.record_id, float(score), record.payload.get("feedback"),
                        metadata if isinstance(metadata, dict) else None)
        for ref in record.references:
            self._apply_report(str(ref), report)

    def _apply_report(self, ref: str, report: Report) -> None:
        if ref in self._consumed or (self._batch is not None and ref in self._batch.record_ids):
            self._count_drop(REPORT_LATE)
            return
        turn = self._open.get(ref)
        if turn is not None:  # no next state yet: the report alone scores it
            self._close(turn)
            self._reported[ref] = report
            self._jobs.append(Job(turn, None, "report", False))
            return
        for i, unit in enumerate(self._units):
            if unit.claims and unit.claims[0] == ref:  # judged already: the report replaces the judge's score
                sample = unit.sample
                meta = {**sample.metadata, **(report.metadata or {})}
                meta["reef"] = {**sample.metadata.get("reef", {}), "correlation": "report",
                                "report_id": report.report_id}
                sample = replace(sample, reward=report.score, feedback=report.feedback, metadata=meta,
                                 source_ids=[*sample.source_ids, report.report_id], report_id=report.report_id)
                self._units[i] = replace(unit, sample=sample, record_ids=(*unit.record_ids, report.report_id))
                return
        if ref in self._in_judge or any(job.turn.record_id == ref for job in self._jobs):
            self._reported[ref] = report  # read when the judge would be asked, or when it answers
            return
        self._reports_ignored += 1

    def _follow_session(self, turn: Turn, hashes: list[str], n_messages: int) -> bool:
        """Pair ``turn`` with its session's previous turn. Returns False when ``turn`` is not tracked (side call)."""
        previous = self._sessions.get(turn.session)
        if previous is None:
            return True
        if turn.prompt_hash == previous.prompt_hash:
            self._retire(previous, RETRIED)
            return True
        extends = n_messages > previous.transcript_len and \
            hashes[previous.transcript_len] == previous.transcript_hash
        if not extends and previous.has_tools and not turn.has_tools:
            self._count_drop(SIDE_CALL)
            return False
        self._pair(previous, turn, "tag", extends)
        return True

    def _follow_transcript(self, turn: Turn, hashes: list[str]) -> None:
        retried = self._by_prompt.get(turn.prompt_hash)
        if retried is not None:
            self._retire(retried, RETRIED)
            return
        # The longest open transcript this request extends by at least one message.
        for k in range(len(hashes) - 2, 0, -1):
            previous = self._by_transcript.get(hashes[k])
            if previous is not None:
                self._pair(previous, turn, "transcript", True)
                return

    def _close(self, turn: Turn) -> None:
        """Remove an open turn from every index."""
        self._open.pop(turn.record_id, None)
        if turn.session is not None:
            if self._sessions.get(turn.session) is turn:
                del self._sessions[turn.session]
        else:
            if self._by_transcript.get(turn.transcript_hash) is turn:
                del self._by_transcript[turn.transcript_hash]
            if self._by_prompt.get(turn.prompt_hash) is turn:
                del self._by_prompt[turn.prompt_hash]

    def _retire(self, turn: Turn, reason: str) -> None:
        self._close(turn)
        if turn.record_id in self._consumed:
            return  # it trained before a restart: nothing is lost
        self._count_drop(reason)

    def _pair(self, previous: Turn, turn: Turn, correlation: str, extends: bool) -> None:
        self._close(previous)
        if previous.record_id in self._consumed:
            self._replayed_consumed += 1
            return
        self._jobs.append(Job(previous, turn, correlation, extends))
        self._pairs[correlation] += 1

    def _refresh(self) -> None:
        if self.session_ttl_s is None:
            return
        cutoff = self._clock() - self.session_ttl_s
        # Oldest first; created_at is (nearly) in arrival order, so stop at the first live turn.
        expired = []
        for turn in self._open.values():
            if turn.created_at > cutoff:
                break
            expired.append(turn)
        for turn in expired:
            self._retire(turn, SESSION_EXPIRED)

    def recheck_after(self) -> float | None:
        """A judge that answered ``wait`` or failed is asked again within a second; the oldest open turn
        expires at ``created_at + session_ttl_s``."""
        with self._lock:
            delays = []
            if self.judge is not None and self._jobs and self._batch is None and len(self._units) < self.batch_size:
                delays.append(JUDGE_RETRY_S)
            if self.session_ttl_s is not None and self._open:
                oldest = next(iter(self._open.values()))
                delays.append(max(0.0, oldest.created_at + self.session_ttl_s - self._clock()))
            return min(delays) if delays else None

    # -- judging (learner's thread, lock released around the judge) ---------------------------------------------------

    def _before_select(self) -> None:
        if self.judge is None and not self._reported:
            return
        tried: set[int] = set()
        while True:
            with self._lock:
                if self._batch is not None or len(self._units) >= self.batch_size or not self._jobs:
                    return
                job = self._jobs[0]
                if id(job) in tried:
                    return  # every job left was asked once in this call
                self._jobs.popleft()
                if job.turn.record_id in self._consumed:
                    self._reported.pop(job.turn.record_id, None)
                    continue
                if self.judge is None and job.turn.record_id not in self._reported:
                    tried.add(id(job))
                    self._jobs.append(job)  # correlate only: it waits for a report
                    continue
                if self._inadmissible(job):
                    self._reported.pop(job.turn.record_id, None)
                    continue
                self._judging += 1
                self._in_judge.add(job.turn.record_id)
                report = self._reported.get(job.turn.record_id)
            tried.add(id(job))
            if report is not None:
                self._score_by_report(job)
                continue
            try:
                pair = self._read_pair(job)
            except Exception:  # noqa: BLE001 - a store hiccup must not stop the learner: ask again later
                log.warning("reading records %s, %s back failed", job.turn.record_id, job.next_turn.record_id,
                            exc_info=True)
                with self._lock:
                    self._judging -= 1
                    self._in_judge.discard(job.turn.record_id)
                    self._jobs.appendleft(job)
                return
            if isinstance(pair, str):
                with self._lock:
                    self._judging -= 1
                    self._in_judge.discard(job.turn.record_id)
                    self._reported.pop(job.turn.record_id, None)
                    if job.turn.record_id not in self._consumed:
                        self._count_drop(pair)
                continue
            turn_record, next_record, next_state = pair
            try:
                result, error = self.judge(turn_record, next_record), None
            except Exception as exc:  # noqa: BLE001 - a failing judge must not stop the learner
                result, error = None, exc
            with self._lock:
                self._judging -= 1
                self._in_judge.discard(job.turn.record_id)
                report = self._reported.pop(job.turn.record_id, None)
                if report is not None:  # a report arrived while the judge ran: it wins
                    self._admit_reported(job, turn_record, next_state, report)
                else:
                    self._apply(job, turn_record, next_state, result, error)

    def _score_by_report(self, job: Job) -> None:
        """A job a report scores: read the turn (and its next request, if any) back, no judge call."""
        try:
            records = ([job.turn.body] if self._load_records is None
                       else list(self._load_records([job.turn.record_id])))
            next_state: list[dict] | str = []
            if job.next_turn is not None:
                pair = self._read_pair(job)
                next_state = pair if isinstance(pair, str) else pair[2]
        except Exception:  # noqa: BLE001 - a store hiccup must not stop the learner: ask again later
            log.warning("reading record %s back failed", job.turn.record_id, exc_info=True)
            with self._lock:
                self._judging -= 1
                self._in_judge.discard(job.turn.record_id)
                self._jobs.appendleft(job)
            return
        with self._lock:
            self._judging -= 1
            self._in_judge.discard(job.turn.record_id)
            report = self._reported.pop(job.turn.record_id, None)
            record = records[0] if len(records) == 1 else None
            if report is None or job.turn.record_id in self._consumed:
                return
            if record is None or record.record_id != job.turn.record_id:
                self._count_drop(RECORD_GONE)
                return
            self._admit_reported(job, record, next_state if isinstance(next_state, list) else [], report)

    def _admit_reported(self, job: Job, record: Record, next_state: list[dict], report: Report) -> None:
        turn = job.turn
        if turn.record_id in self._consumed:
            return
        extra = {"next_record_id": job.next_turn.record_id if job.next_turn is not None else None,
                 "next_state": next_state, "correlation": "report", "report_id": report.report_id,
                 "session": turn.session}
        try:
            sample = trajectory_sample(self.scenario, [record], reward=report.score, feedback=report.feedback,
                                       metadata=report.metadata, report_id=report.report_id, extra=extra)
        except UnusableRecord:
            self._count_drop(el.NOT_CHAT)
            return
        unit = Unit(sample=sample, record_ids=(turn.record_id, report.report_id), claims=(turn.record_id,),
                    arrived_at=turn.created_at)
        self._claim(unit)
        self._units.append(unit)

    def _read_pair(self, job: Job) -> tuple[Record, Record, list[dict]] | str:
        """``(turn record, next record, next state)`` of a pair, read back from the store (or the kept bodies),
        or the reason the pair cannot be judged. Runs without the lock."""
        ids = [job.turn.record_id, job.next_turn.record_id]
        if self._load_records is None:
            records = [job.turn.body, job.next_turn.body]
        else:
            records = list(self._load_records(ids))
        if len(records) != 2 or any(r is None or r.record_id != i for r, i in zip(records, ids)):
            return RECORD_GONE
        if any(is_compacted(r) for r in records):
            return el.COMPACTED
        try:
            messages, reply = exchange_of(records[0])
            following, _ = exchange_of(records[1])
        except UnusableRecord:
            return el.NOT_CHAT
        start = job.turn.transcript_len if job.extends else common_prefix([*messages, reply], following)
        return records[0], records[1], following[start:]

    def _inadmissible(self, job: Job) -> bool:
        """Drop a pair whose turn cannot train anyway, before paying for a judge call."""
        if not self._staleness.enabled:
            return False
        serving = self._staleness.serving()
        if serving is None:
            return False
        why = self._staleness.reason([job.turn.version], serving)
        if why is not None:
            self._count_drop(why)
            return True
        return False

    def _apply(self, job: Job, record: Record, next_state: list[dict], result, error: BaseException | None) -> None:
        turn = job.turn
        if turn.record_id in self._consumed:
            return  # restored while the judge ran
        if error is not None:
            job.attempts += 1
            if job.attempts >= self.max_judge_attempts:
                log.warning("judge failed %d times on %s: %s", job.attempts, turn.record_id, error)
                self._count_drop(JUDGE_ERROR)
            else:
                self._jobs.append(job)
            return
        if result == "wait":
            job.waits += 1
            self._jobs.append(job)
            return
        if result == "never":
            self._count_drop(JUDGE_NEVER)
            return
        if isinstance(result, dict) and "never" in result:  # a judge that says why: counted under its reason
            why = result["never"]
            self._count_drop(why if isinstance(why, str) and why.strip() else JUDGE_NEVER)
            return
        feedback, metadata = None, {}
        if isinstance(result, dict):
            feedback = result.get("feedback")
            metadata = result.get("metadata") if isinstance(result.get("metadata"), dict) else {}
            result = result.get("score")
        if isinstance(result, bool) or not isinstance(result, (int, float)) or not math.isfinite(result):
            self._count_drop(JUDGE_INVALID)
            return
        extra = {"next_record_id": job.next_turn.record_id, "next_state": next_state,
                 "correlation": job.correlation, "session": turn.session, "judge_waits": job.waits}
        sample = trajectory_sample(self.scenario, [record], reward=float(result), feedback=feedback,
                                   metadata=metadata, extra=extra)
        unit = Unit(sample=sample, record_ids=(turn.record_id,), claims=(turn.record_id,),
                    arrived_at=turn.created_at)
        self._claim(unit)
        self._units.append(unit)

    # -- batches ------------------------------------------------------------------------------------------------------

    def protected_ids(self) -> set[str]:
        """The units' records, and every turn still waiting for its next state or judge (retention keeps them)."""
        with self._lock:
            ids = super().protected_ids()
            ids.update(self._open)
            for job in self._jobs:
                ids.add(job.turn.record_id)
                if job.next_turn is not None:
                    ids.add(job.next_turn.record_id)
            return ids

    def _waiting_units(self) -> Iterable[Unit]:
        return self._units

    def _evict_inadmissible(self, verdicts: dict[int, str]) -> None:
        kept: deque[Unit] = deque()
        for unit in self._units:
            why = verdicts.get(id(unit))
            if why is None:
                kept.append(unit)
            else:
                self._drop_unit(unit, why)
        self._units = kept

    def _can_select(self) -> bool:
        return len(self._units) >= self.batch_size

    def _select(self) -> list[Unit] | None:
        if not self._can_select():
            return None
        return [self._units.popleft() for _ in range(self.batch_size)]

    def _put_back(self, units: list[Unit]) -> None:
        self._units.extendleft(reversed(units))

    def _status_extra(self) -> dict:
        return {"batch_size": self.batch_size, "judge": self.judge is not None, "open_turns": len(self._open),
                "sessions": len(self._sessions), "pairs_waiting_for_judge": len(self._jobs) + self._judging,
                "pairs_by_correlation": dict(self._pairs), "reports_ignored": self._reports_ignored}
