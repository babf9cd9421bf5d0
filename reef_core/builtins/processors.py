"""Built-in processors (registered through hooks): ``per_report``, ``grouped``, ``grid`` and ``next_state``.

Every factory is called as ``factory(*, scenario, options, serving_version, judge=None, load_records=None,
**context)`` and returns a ``reef_core.api.Processor``. ``options`` come from the recipe config
(``recipe.processor_options``, a dict); keys may be snake_case or kebab-case (``max-staleness``), unknown keys are a
:class:`ConfigError`. ``load_records(ids)`` reads stored records back by id (processors hold ids, not bodies). Extra
context keywords are accepted and ignored, so the host may pass more than a processor needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import hookimpl
from ..plugins import load_callable
from ..errors import ConfigError

_REPORTED = ("batch_size", "max_staleness", "require_score", "max_held_inferences", "holdout", "max_replay_tasks")
_GROUPED = ("batch_size", "group_size", "key", "groups_per_batch", "partial_policy", "timeout_s", "min_partial_size", "slot",
            "max_staleness", "require_score", "max_held_inferences")
_GRID = ("batch_size", "groups", "rollouts_per_group", "timeout_s", "max_staleness", "max_held_inferences",
         "drop_constant_groups", "sequential")
_NEXT_STATE = ("batch_size", "max_staleness", "session_tag", "session_ttl_s", "max_open_turns",
               "max_judge_attempts", "judge")


def _options(kind: str, options: Any, allowed: tuple[str, ...]) -> dict:
    """``options`` as a plain dict with snake_case keys, refusing keys ``kind`` does not know."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"processor {kind!r}: options must be a mapping")
    out = {}
    for key, value in options.items():
        name = str(key).replace("-", "_")
        if name not in allowed:
            raise ConfigError(f"processor {kind!r} has no option {key!r} (known: {', '.join(sorted(allowed))})")
        out[name] = value
    return out


def _build(kind: str, cls, **kwargs):
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"processor {kind!r}: {exc}") from exc


def make_per_report(*, scenario: str, options: Any = None, serving_version=None, judge=None, load_records=None,
                    **_context):
    from ..observe.processors import PerReportProcessor

    opts = _options("per_report", options, _REPORTED)
    return _build("per_report", PerReportProcessor, scenario=scenario, serving_version=serving_version,
                  load_records=load_records, **opts)


def make_grouped(*, scenario: str, options: Any = None, serving_version=None, judge=None, load_records=None,
                 **_context):
    from ..observe.processors import GroupedProcessor

    opts = _options("grouped", options, _GROUPED)
    if "group_size" not in opts:
        raise ConfigError("processor 'grouped' needs the option group_size")
    # batch_size is accepted as a cross-check: a batch is groups_per_batch complete groups.
    batch_size = opts.pop("batch_size", None)
    expected = int(opts["group_size"]) * int(opts.get("groups_per_batch", 1))
    if batch_size is not None and int(batch_size) != expected:
        raise ConfigError(f"processor 'grouped': batch_size {batch_size} must equal group_size x groups_per_batch "
                          f"({expected})")
    return _build("grouped", GroupedProcessor, scenario=scenario, serving_version=serving_version,
                  load_records=load_records, **opts)


def make_grid(*, scenario: str, options: Any = None, serving_version=None, judge=None, load_records=None,
              **_context):
    from ..observe.processors import GridProcessor

    opts = _options("grid", options, _GRID)
    missing = [name for name in ("groups", "rollouts_per_group") if name not in opts]
    if missing:
        raise ConfigError(f"processor 'grid' needs the option(s) {', '.join(missing)}")
    # batch_size is accepted as a cross-check: one batch is one whole step.
    batch_size = opts.pop("batch_size", None)
    try:
        expected = int(opts["groups"]) * int(opts["rollouts_per_group"])
    except (TypeError, ValueError):
        raise ConfigError("processor 'grid': groups and rollouts_per_group must be positive integers") from None
    if batch_size is not None and batch_size != expected:
        raise ConfigError(f"processor 'grid': batch_size {batch_size} must equal groups x rollouts_per_group "
                          f"({expected}), or the barrier never matches the trainer's batch")
    return _build("grid", GridProcessor, scenario=scenario, serving_version=serving_version,
                  load_records=load_records, **opts)


def make_next_state(*, scenario: str, options: Any = None, serving_version=None, judge=None, load_records=None,
                    **_context):
    from ..observe.processors import NextStateProcessor

    opts = _options("next_state", options, _NEXT_STATE)
    named = opts.pop("judge", None)
    if judge is None and named:
        judge = load_callable(str(named), "judge")
    return _build("next_state", NextStateProcessor, scenario=scenario, serving_version=serving_version,
                  judge=judge, load_records=load_records, **opts)


def _checker(kind: str, allowed: tuple[str, ...]):
    def check_options(*, recipe) -> None:
        _options(kind, recipe.processor_options, allowed)

    return check_options


@hookimpl
def reef_register_processors(register):
    register("per_report", make_per_report, check_options=_checker("per_report", _REPORTED),
             description="one sample per report; several receipts form one multi-turn trajectory")
    register("grouped", make_grouped, check_options=_checker("grouped", _GROUPED),
             description="samples released in complete groups sharing a key (prompt, task, metadata field)")
    register("grid", make_grid, check_options=_checker("grid", _GRID),
             description="whole-step barrier: a step of G groups x R rollouts trains only when complete")
    register("next_state", make_next_state, check_options=_checker("next_state", _NEXT_STATE),
             description="each turn judged by the next request of its conversation (session tag or transcript)")
