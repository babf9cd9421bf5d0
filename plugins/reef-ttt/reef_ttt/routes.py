"""The scenario routes of ``ttt`` (registered through ``reef_register_scenario_routes``).

``GET /reef/scenarios/{s}/ttt/plan``
    ``{"step", "serving_version", "groups": [{"group", "parent_id", "parent": {"state", "value"}, "prompt"}],
    "groups_per_step", "rollouts_per_group", "mode", "task", "task_options", "executor", "guidance_tags"}``: the step
    to report now (the grid barrier's open step), the parents PUCT picks from the committed archive and the prompt
    to sample each group's R rollouts from. While a step trains, the plan still names it (its slots are taken):
    clients wait until ``step`` moves on.
``GET /reef/scenarios/{s}/ttt/archive``
    ``{"best": {"score", "state", "step"}, "size", "history", "expansions", "step"}``; ``?limit=N`` (0-1000) adds
    the N best entries (id, value, parent, visits, step; no states).

The core checks the scenario (400/404/503) before a handler runs; a handler refuses unknown query parameters and
bad values with a 400 naming the parameter. Neither route changes anything.
"""

from __future__ import annotations

from typing import Any

from reef_core.api import NotFound, ValidationFailed

MAX_LIMIT = 1000


def _query(query: dict, allowed: tuple[str, ...]) -> None:
    for name in query:
        if name not in allowed:
            hint = f"; allowed: {', '.join(allowed)}" if allowed else "; this route takes none"
            raise ValidationFailed(f"unknown query parameter {name!r}{hint}", param=name)


def _committed(view) -> tuple[Any, Any, int, Any]:
    """``(options, task, open step, archive of the serving release)``. The step is read before the archive: a step
    the processor closed was committed before, so the archive is never behind the step. A scenario not stored yet
    (no processor) is at step 0 with the seeded archive."""
    if view.processor is None:
        from reef_ttt.options import TTTOptions
        from reef_ttt.task import load_task
        from reef_ttt.trainer import seeded_archive

        opts = TTTOptions.from_options(view.recipe.options)
        task = load_task(opts.task, opts.task_options)
        return opts, task, 0, seeded_archive(task, opts)
    trainer = view.trainer()
    if trainer is None or not hasattr(trainer, "archive_of"):
        raise NotFound(f"scenario {view.name!r} has no TTT trainer")
    step = view.processor.current_step()
    release_id = view.current_release_id()
    archive = trainer.archive_of(release_id, lambda: view.release_files(release_id))
    return trainer.opts, trainer.task, step, archive


def plan(view, query: dict) -> dict[str, Any]:
    _query(query, ())
    opts, task, step, archive = _committed(view)
    guidance = opts.mode == "guidance"
    groups = []
    for group, parent_id in enumerate(archive.select(opts.groups_per_step)):
        entry = archive.entries[parent_id]
        groups.append({"group": group, "parent_id": parent_id,
                       "parent": {"state": entry.state, "value": entry.value},
                       "prompt": task.prompt(entry.state, entry.value, guidance=guidance)})
    return {"step": step, "serving_version": view.serving_version(), "groups": groups,
            "groups_per_step": opts.groups_per_step, "rollouts_per_group": opts.rollouts_per_group,
            "mode": opts.mode, "task": opts.task, "task_options": dict(opts.task_options),
            "executor": opts.executor, "guidance_tags": opts.guidance_tags}


def archive(view, query: dict) -> dict[str, Any]:
    _query(query, ("limit",))
    limit = 0
    if "limit" in query:
        raw = query["limit"]
        if not raw.isdigit() or int(raw) > MAX_LIMIT:
            raise ValidationFailed(f"limit must be an integer in [0, {MAX_LIMIT}], not {raw[:40]!r}", param="limit")
        limit = int(raw)
    _opts, _task, step, arch = _committed(view)
    body = {**arch.summary(), "step": step}
    if limit:
        top = sorted(arch.entries.values(), key=lambda e: (-e.value, e.id))[:limit]
        body["entries"] = [{"id": e.id, "value": e.value, "parent": e.parent, "visits": e.visits, "step": e.step,
                            "seed": e.seed} for e in top]
    return body
