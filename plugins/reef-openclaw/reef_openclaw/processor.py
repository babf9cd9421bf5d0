"""The ``openclaw`` processor: Reef's ``next_state`` processor with a registered judge and OpenClaw's dispatch.

Correlation is the core's (:class:`reef_core.api.NextStateProcessor`): sessions by the ``x-reef-tag-session`` tag
(transcript matching without it), retries and side calls retired, a turn nothing followed within ``session_ttl_s``
expires, so the last turn of a session never trains. Judging runs on the learner's thread, never on the request
path. Each pair is handed to the judge as plain dicts (:func:`~reef_openclaw.judges.turn_view`,
:func:`~reef_openclaw.judges.next_state_view`) and its verdict goes through
:func:`~reef_openclaw.judges.dispatch`; a trained sample carries ``metadata["openclaw"] = {"score", "hints",
"teacher", "source"}`` for the trainer. ``status()["openclaw"]`` holds the judge's cost (calls, failed votes,
seconds) and the dispatch counts; a turn that does not train is counted in ``status()["dropped"]`` under its reason:
``no_next_state``, ``retired_neutral`` (score 0, no hint) or ``judge_failed`` (no vote of the judge's was valid).

Options (``recipe.processor_options``): the ``next_state`` processor's (``batch_size``, ``max_staleness``,
``session_tag``, ``session_ttl_s``, ``max_open_turns``, ``max_judge_attempts``) plus ``judge`` (a registered judge
name: ``prm``, ``callable``; or ``"package.module:function"``, short for the ``callable`` judge of that function) and
``judges`` (options per judge name, e.g. ``judges.prm.m``; only the selected judge's are used).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from reef_core.api import ConfigError, NextStateProcessor, Record

from reef_openclaw.judges import JUDGE_FAILED, TEACHER_HINT, dispatch, make_callable_judge, next_state_view, \
    turn_view

_NEXT_STATE = ("batch_size", "max_staleness", "session_tag", "session_ttl_s", "max_open_turns", "max_judge_attempts")
_OWN = ("judge", "judges")


class OpenClawProcessor(NextStateProcessor):
    """``next_state`` correlation + a judge of plain dicts + OpenClaw's dispatch (see the module docstring)."""

    name = "openclaw"

    def __init__(self, scenario: str, *, judge: Callable[..., dict] | None, **options):
        self.openclaw_judge = judge
        self._counts: Counter = Counter()
        self._counts_lock = threading.Lock()
        super().__init__(scenario, judge=self._judge_pair if judge is not None else None, **options)

    def _count(self, key: str) -> None:
        with self._counts_lock:
            self._counts[key] += 1

    def _judge_pair(self, turn: Record, following: Record):
        """The core judge contract ``(turn record, next record) -> score | dict | "never"``."""
        state = next_state_view(turn, following)
        if state is None:
            self._count("no_next_state")
            return {"never": "no_next_state"}
        verdict = self.openclaw_judge(turn=turn_view(turn), next_state=state)
        outcome = dispatch(verdict)
        if outcome is None:
            # Dropped under its own reason (status "dropped", reef_samples_dropped_total): a judge whose every vote
            # failed is judge_failed, not a neutral verdict.
            why = JUDGE_FAILED if verdict.get("failed") else "retired_neutral"
            self._count(why)
            return {"never": why}
        reward, teacher = outcome
        self._count("hint_and_score" if teacher == TEACHER_HINT and reward != 0 else
                    "hint_only" if teacher == TEACHER_HINT else "score_only")
        hints = list(verdict.get("hints") or []) if teacher == TEACHER_HINT else []
        return {"score": reward, "metadata": {"openclaw": {"score": reward, "hints": hints, "teacher": teacher,
                                                           "source": "judge"}}}

    def status(self) -> dict:
        out = super().status()
        status = getattr(self.openclaw_judge, "status", None)
        with self._counts_lock:
            dispatched = dict(sorted(self._counts.items()))
        out["openclaw"] = {"judge": status() if callable(status) else {}, "dispatch": dispatched}
        return out


def _builtin_judge(name: str, **kwargs):
    """Build a built-in judge without a plugin manager (offline use, tests)."""
    from reef_openclaw.prm import make_prm_judge

    table = {"prm": make_prm_judge, "callable": make_callable_judge}
    if name not in table:
        raise ConfigError(f"no judge named {name!r}; available: {', '.join(sorted(table))}")
    return table[name](**kwargs)


def build_judge(spec: Any, judges: Any = None, *, create: Callable[..., Any] | None = None, engine: Any = None,
                run_async: Any = None):
    """The judge named by ``spec`` (``processor_options.judge``), with its options from ``judges[name]``."""
    if judges is None:
        judges = {}
    if not isinstance(judges, Mapping):
        raise ConfigError("openclaw: processor_options.judges must be a mapping of judge name -> options")
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"openclaw: recipe.judge must be a judge name (prm, callable) or "
                          f"'package.module:function', got {spec!r}")
    name, function = ("callable", spec) if ":" in spec else (spec, None)  # a function is the callable judge
    options = judges.get(name) or {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"openclaw: processor_options.judges.{name} must be a mapping")
    options = dict(options)
    if function is not None:
        if options.get("function") not in (None, function):
            raise ConfigError("openclaw: recipe.judge names a function and "
                              "processor_options.judges.callable.function names another")
        options["function"] = function
    if create is None:
        return _builtin_judge(name, options=options, engine=engine, run_async=run_async)
    return create("judge", name, options=options, engine=engine, run_async=run_async)


def check_options(options: Any) -> dict:
    """``options`` with snake_case keys; a key the processor does not know is a :class:`ConfigError`."""
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ConfigError("processor 'openclaw': options must be a mapping")
    opts = {}
    for key, value in options.items():
        name = str(key).replace("-", "_")
        if name not in _NEXT_STATE + _OWN:
            raise ConfigError(f"processor 'openclaw' has no option {key!r} (known: "
                              f"{', '.join(sorted(_NEXT_STATE + _OWN))})")
        opts[name] = value
    return opts


def make_openclaw_processor(*, scenario: str, options: Any = None, serving_version=None, judge=None,
                            load_records=None, create=None, engine=None, run_async=None, **_context):
    """``openclaw`` processor factory (registered through ``reef_register_processors``)."""
    opts = check_options(options)
    spec, judges = opts.pop("judge", "prm"), opts.pop("judges", None)
    the_judge = judge if judge is not None else build_judge(spec, judges, create=create, engine=engine,
                                                            run_async=run_async)
    if getattr(the_judge, "scenario", False) is None:  # a judge that names its scenario in its log lines
        the_judge.scenario = scenario
    try:
        return OpenClawProcessor(scenario, judge=the_judge, serving_version=serving_version,
                                 load_records=load_records, **opts)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"processor 'openclaw': {exc}") from exc
