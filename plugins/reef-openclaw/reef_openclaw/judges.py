"""Judges of a turn by its next state: the contract, the vote and hint rules, the dispatch table.

A judge is called as ``judge(turn=..., next_state=...)`` with plain dicts (see :func:`turn_view` and
:func:`next_state_view`) and returns a :data:`Verdict`: ``{"score": float, "hints": [str, ...]}``. Two are built in
(registered through ``reef_register_judges``): ``prm`` (:mod:`reef_openclaw.prm`: votes of a chat model) and
``callable`` (:class:`CallableJudge`: a Python function, for rule-based judges and tests).

:func:`dispatch` turns a verdict into what the trainer gets (OpenClaw-RL's table)::

    hints  score   outcome
    yes    ±1      reward = score, teacher = the frozen base after the hinted prompt
    yes    0       reward = 0,     teacher = the frozen base after the hinted prompt
    no     ±1      reward = score, teacher = the frozen base after the plain prompt (the "anchor")
    no     0       retired: nothing to learn from
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from reef_core.api import ConfigError, Record, common_prefix, content_text, exchange_of, load_callable

log = logging.getLogger(__name__)

#: A judge's answer: ``{"score": float, "hints": [str, ...]}`` (hints already filtered by :func:`select_hints`),
#: plus ``"failed": True`` when no vote was valid (the turn is dropped as :data:`JUDGE_FAILED`, not retired neutral).
Verdict = dict

#: The drop reason of a turn whose judge gave no valid vote (status ``dropped``, ``reef_samples_dropped_total``).
JUDGE_FAILED = "judge_failed"

#: A hint is kept only when longer than this many characters (shorter ones carry no instruction).
HINT_MIN_CHARS = 10
HINT_START, HINT_END = "[HINT_START]", "[HINT_END]"
#: Teacher kinds recorded in a sample's ``metadata["openclaw"]["teacher"]``.
TEACHER_HINT, TEACHER_BASE = "hint", "base"

_BOXED = re.compile(r"\\boxed\{\s*([^{}]*?)\s*\}")
_VOTES = {"1": 1, "+1": 1, "-1": -1, "0": 0}


def parse_boxed(text: Any) -> int | None:
    """The LAST ``\\boxed{...}`` value of ``text`` as 1, -1 or 0; None when there is none or it is something else."""
    if not isinstance(text, str):
        return None
    found = _BOXED.findall(text)
    if not found:
        return None
    return _VOTES.get(found[-1].strip())


def plurality(votes: Iterable[int | None]) -> int:
    """The most frequent valid vote; 0 when no vote is valid or the top count is shared (a tie)."""
    counts = Counter(v for v in votes if v is not None)
    if not counts:
        return 0
    (top, n), *rest = counts.most_common()
    if rest and rest[0][1] == n:
        return 0
    return top


def extract_hint(text: Any) -> str | None:
    """The text between the last ``[HINT_START]`` and the ``[HINT_END]`` after it, stripped; None when absent."""
    if not isinstance(text, str):
        return None
    start = text.rfind(HINT_START)
    if start < 0:
        return None
    end = text.find(HINT_END, start + len(HINT_START))
    if end < 0:
        return None
    return text[start + len(HINT_START):end].strip()


def select_hints(hints: Iterable[Any], limit: int = 3) -> list[str]:
    """Hint candidates: strings longer than :data:`HINT_MIN_CHARS` once stripped, deduplicated, shortest first, at
    most ``limit``."""
    kept: list[str] = []
    for hint in hints:
        if not isinstance(hint, str):
            continue
        hint = hint.strip()
        if len(hint) > HINT_MIN_CHARS and hint not in kept:
            kept.append(hint)
    kept.sort(key=len)  # stable: equal lengths keep their vote order
    return kept[:max(0, int(limit))]


def dispatch(verdict: Verdict) -> tuple[float, str] | None:
    """``(reward, teacher)`` of a verdict by the table in the module docstring, or None: the turn is retired."""
    score, hints = float(verdict["score"]), verdict.get("hints") or []
    if hints:
        return score, TEACHER_HINT
    if score != 0.0:
        return score, TEACHER_BASE
    return None


# -- the views a judge receives ----------------------------------------------------------------------------------------


def turn_view(record: Record) -> dict:
    """``{"messages", "reply", "agent_record_id", "tags"}`` of a turn's inference record (messages are the request's
    OpenAI-style chat turns, whatever dialect the client spoke; ``reply`` is the assistant's text)."""
    messages, reply = exchange_of(record)
    return {"messages": messages, "reply": content_text(reply.get("content"), non_text="skip"),
            "agent_record_id": record.record_id, "tags": dict(record.tags)}


def next_state_view(turn: Record, following: Record) -> dict | None:
    """``{"role": "user" | "tool", "content"}``: what the request after ``turn`` added to its conversation.

    The first new ``user`` or ``tool`` message, joined with the messages of the same role right after it (several
    tool results answer one call); None when the next request added neither."""
    messages, reply = exchange_of(turn)
    later, _ = exchange_of(following)
    new = later[common_prefix([*messages, reply], later):]
    for i, message in enumerate(new):
        role = message.get("role")
        if role not in ("user", "tool"):
            continue
        parts = []
        for other in new[i:]:
            if other.get("role") != role:
                break
            parts.append(content_text(other.get("content"), non_text="skip"))
        return {"role": role, "content": "\n".join(p for p in parts if p)}
    return None


# -- the callable judge ------------------------------------------------------------------------------------------------


class JudgeMeter:
    """Thread-safe cost counters of a judge: calls, seconds spent, failed votes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls = 0
        self.failed = 0
        self.seconds = 0.0

    def add(self, *, calls: int = 0, failed: int = 0, seconds: float = 0.0) -> None:
        with self._lock:
            self.calls += calls
            self.failed += failed
            self.seconds += seconds

    def status(self) -> dict:
        with self._lock:
            return {"calls": self.calls, "failed_votes": self.failed, "seconds": round(self.seconds, 3)}


class CallableJudge:
    """``function(turn=..., next_state=...) -> {"score": float, "hint": str | None}`` as a judge.

    The function's answer is one vote: one that raises, or returns anything but a dict with a finite number as
    ``score``, is a failed vote (score 0, no hint). The hint passes the same rule as the ``prm`` judge's."""

    def __init__(self, function: Callable[..., Any], name: str = "callable"):
        if not callable(function):
            raise ConfigError(f"judge {name!r} is not callable")
        self.function = function
        self.name = name
        self.meter = JudgeMeter()
        #: The scenario whose processor asks this judge (one judge per processor), for the log line.
        self.scenario: str | None = None
        self._warned: set[str] = set()

    def __call__(self, *, turn: dict, next_state: dict) -> Verdict:
        started = time.monotonic()
        reason = None
        try:
            answer = self.function(turn=turn, next_state=next_state)
            score = answer.get("score") if isinstance(answer, dict) else None
            ok = not isinstance(score, bool) and isinstance(score, (int, float)) and math.isfinite(score)
            if not ok:
                reason, detail = "it answered no finite score", repr(answer)[:300]
        except Exception as exc:  # noqa: BLE001 - a failing rule is a failed vote, never a failed learner
            answer, score, ok = None, None, False
            reason, detail = f"it raised {type(exc).__name__}", str(exc)[:300]
        self.meter.add(calls=1, failed=0 if ok else 1, seconds=time.monotonic() - started)
        if not ok:
            self._warn(reason, detail)
            return {"score": 0.0, "hints": [], "failed": True}
        return {"score": float(score), "hints": select_hints([answer.get("hint")], limit=1)}

    def _warn(self, reason: str, detail: str) -> None:
        # Once per reason (the judge is its scenario's): a broken rule retires every turn neutral, and the
        # failed_votes counter alone is easy to miss; a line per vote would flood the log.
        with self.meter._lock:
            if reason in self._warned:
                return
            self._warned.add(reason)
        log.warning("judge %s (scenario %s): a vote failed, %s: %s; the turn is scored 0 and counted in "
                    "failed_votes (logged once per reason)", self.name, self.scenario or "?", reason, detail)

    def status(self) -> dict:
        return {"kind": "callable", "function": self.name, **self.meter.status()}


def make_callable_judge(*, options: dict | None = None, **_context) -> CallableJudge:
    """``callable`` judge factory: ``options["function"]`` is ``"package.module:function"``."""
    options = dict(options or {})
    unknown = sorted(set(options) - {"function"})
    if unknown:
        raise ConfigError(f"judge 'callable': unknown option(s) {', '.join(unknown)} (known: function)")
    path = options.get("function")
    if not isinstance(path, str) or ":" not in path:
        raise ConfigError("judge 'callable' needs recipe.processor_options.judges.callable.function = "
                          "'package.module:function' (or recipe.judge = 'package.module:function')")
    return CallableJudge(load_callable(path, "judge function"), name=path)
