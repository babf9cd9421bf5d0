"""``reef eval releases``: score a scenario's retained releases on held-out task sets, recording nothing.

The releases are the scenario's chain (the releases that served it, oldest first; releases held for review are not
in it), optionally cut to ``--from``/``--to`` (inclusive) or to the ``--last N`` retained ones. A release whose
weights were garbage-collected (``reef gc``) is listed under ``skipped``. Each is answered by a private engine
(:mod:`reef_core.loop.release_eval`) and scored with ``learn.verifier`` (the task-file format of ``reef sweep
task=learn``). No record store is opened, no learner runs, no release is written: the only output is the result
document, printed and kept under the data directory (:mod:`reef_core.loop.eval_results`) for the dashboard.

Every argument is checked before a model loads; a bad one is a :class:`ConfigError` naming it (exit 2).
"""

from __future__ import annotations

import dataclasses
import datetime
import fnmatch
import hashlib
import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, Conflict
from ..grow.eval_engine import EvalGeneration
from ..progress import Progress
from .eval_results import FORMAT, forgetting, save_run
from .release_eval import KINDS, LoadFailed, release_runner
from .taskfile import load_tasks, make_verifier, resolve_task_file

_SET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_RELEASE_ID = re.compile(r"[0-9a-f]{7,40}")
#: Episode errors kept per release in the result.
MAX_ERRORS = 5


@dataclass(frozen=True)
class TaskFile:
    """One ``--tasks`` file: its label (the set of its untagged tasks), path, digest and tasks."""

    label: str
    path: Path
    sha256: str
    tasks: list


def task_files(specs: list[str]) -> list[TaskFile]:
    """``--tasks FILE`` or ``--tasks NAME=FILE``, each a JSONL task file (its set: ``NAME``, else the file's stem)."""
    if not specs:
        raise ConfigError("--tasks: name at least one JSONL task file")
    out: list[TaskFile] = []
    for spec in specs:
        label, sep, rest = spec.partition("=")
        if not (sep and _SET_NAME.fullmatch(label)):
            label, rest = "", spec
        path = resolve_task_file(rest, "--tasks")
        label = label or path.stem
        if not _SET_NAME.fullmatch(label):
            raise ConfigError(f"--tasks {spec!r}: set name {label!r} must be 1-64 letters, digits, '_', '.' or '-' "
                              "(name it: --tasks NAME=FILE)")
        if any(f.label == label for f in out):
            raise ConfigError(f"--tasks: two task files are named {label!r}; name them: --tasks NAME=FILE")
        tasks = load_tasks(rest, key="--tasks")
        out.append(TaskFile(label, path, hashlib.sha256(path.read_bytes()).hexdigest(), tasks))
    return out


def task_sets(files: list[TaskFile]) -> dict[str, list[dict]]:
    """Set name -> its tasks: a task's own ``set`` field, else its file's label."""
    sets: dict[str, list[dict]] = {}
    for file in files:
        for number, task in enumerate(file.tasks, start=1):
            name = task.get("set", file.label)
            if not (isinstance(name, str) and _SET_NAME.fullmatch(name)):
                raise ConfigError(f"--tasks {file.path.name} task {number}: 'set' must be 1-64 letters, digits, "
                                  f"'_', '.' or '-', not {name!r}")
            sets.setdefault(name, []).append(task)
    return sets


def check_verifier_fields(name: str, options: dict, files: list[TaskFile]) -> None:
    """A built-in verifier's field must be in every task (``exact_match``: ``expected``...): refused here, naming
    the task, rather than scored as a failure at every release."""
    field = {"exact_match": options.get("key", "expected"),
             "regex": None if options.get("pattern") else options.get("key", "pattern"),
             "json_schema": None if options.get("schema") else options.get("key", "schema")}.get(name)
    if field is None:
        return
    for file in files:
        for number, task in enumerate(file.tasks, start=1):
            if field not in task:
                raise ConfigError(f"--tasks {file.path.name} task {number}: no {field!r} field, which "
                                  f"learn.verifier={name} reads (set learn.verifier and learn.verifier_options)")


def release_kind(cfg, scenario: str, plugin_manager):
    """(kind, the recipe binding) of the recipe the config binds ``scenario`` to (its routes, as ``reef serve``)."""
    from ..config.recipes import recipe_bindings

    name = next((r.recipe for r in cfg.routes if fnmatch.fnmatchcase(scenario, r.pattern)), cfg.recipe.name)
    binding = recipe_bindings(cfg, plugin_manager)[name]
    surface = binding.config.surface
    if surface is None:
        raise ConfigError(f"scenario {scenario!r}: recipe {name!r} serves no surface, so its releases cannot be "
                          "served here; name the recipe that made them (e.g. +recipe=sao)")
    if surface not in KINDS:
        raise ConfigError(f"scenario {scenario!r}: recipe {name!r} serves {surface!r} releases; reef eval releases "
                          f"evaluates {' and '.join(KINDS)} releases only")
    return surface, binding


def _position(chain: list, value: str, flag: str, scenario: str) -> int:
    wanted = value.strip().lower().removeprefix("git+lfs://")
    if not _RELEASE_ID.fullmatch(wanted):
        raise ConfigError(f"{flag} {value!r}: a release id is 7 to 40 hex digits")
    hits = [i for i, release in enumerate(chain) if release.release_id.startswith(wanted)]
    if not hits:
        raise ConfigError(f"{flag} {value!r}: no release of scenario {scenario!r}'s chain has this id")
    if len(hits) > 1:
        raise ConfigError(f"{flag} {value!r} names {len(hits)} releases of scenario {scenario!r}; give more digits")
    return hits[0]


def select(chain: list, scenario: str, first: str | None = None, last: str | None = None,
           last_n: int | None = None) -> tuple[list[tuple[int, object]], list[tuple[int, object]]]:
    """(releases to evaluate, pruned ones) as ``(chain position, release)``, oldest first; ``chain`` oldest
    first."""
    if last_n is not None and (first or last):
        raise ConfigError("--last cannot be combined with --from or --to")
    if last_n is not None and last_n < 1:
        raise ConfigError(f"--last must be at least 1, got {last_n}")
    start = _position(chain, first, "--from", scenario) if first else 0
    end = _position(chain, last, "--to", scenario) if last else len(chain) - 1
    if start > end:
        raise ConfigError(f"--from {first!r} comes after --to {last!r} in scenario {scenario!r}'s chain")
    picked = list(enumerate(chain))[start:end + 1]
    kept = [(i, r) for i, r in picked if r.restorable]
    pruned = [(i, r) for i, r in picked if not r.restorable]
    if last_n is not None:
        kept = kept[-last_n:]
        pruned = [(i, r) for i, r in pruned if not kept or i > kept[0][0]]
    if not kept:
        raise ConfigError(f"scenario {scenario!r}: no retained release to evaluate in the range "
                          f"({len(pruned)} pruned by reef gc)")
    return kept, pruned


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _mean(values: list) -> float | None:
    real = [v for v in values if v is not None]
    return statistics.fmean(real) if real else None


def _score(reply, sets: dict[str, list[dict]], verify, advance) -> dict:
    """Scores of one release per set; an episode whose generation or verifier raises scores None (its error kept),
    and weights that do not load stop the release (``error``)."""
    from ..commit.evaluators import as_score

    scores, errors, done = {name: [] for name in sets}, [], 0
    for name, tasks in sets.items():
        for task in tasks:
            try:
                value = as_score(verify(reply(task["messages"]), task))
            except LoadFailed as exc:
                advance(sum(len(t) for t in sets.values()) - done)
                return {"scores": {n: None for n in sets}, "episodes": {n: 0 for n in sets},
                        "failed": {n: 0 for n in sets}, "errors": [], "error": exc.message}
            except Exception as exc:  # noqa: BLE001 - an infrastructure fault or a verifier's: scored None
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
                value = None
            scores[name].append(value)
            done += 1
            advance(1)
    return {"scores": {n: _mean(v) for n, v in scores.items()}, "episodes": {n: len(v) for n, v in scores.items()},
            "failed": {n: sum(s is None for s in v) for n, v in scores.items()}, "errors": errors[:MAX_ERRORS],
            "error": None}


def _row(index: int, release) -> dict:
    step = release.metrics.get("step", release.source.get("step"))
    return {"index": index, "release_id": release.release_id, "operation": release.operation,
            "created_at": release.created_at, "step": step, "current": release.current}


def run_eval_releases(cfg, *, scenario: str, tasks: list[str], first: str | None = None, last: str | None = None,
                      last_n: int | None = None, max_tokens: int | None = None, save: bool = True) -> int:
    """Evaluate, print the result document (JSON) and keep it unless ``save`` is false; 0, or 1 when a release's
    weights failed to load."""
    from ..plugins import get_plugin_manager

    if not scenario:
        raise ConfigError("--scenario: name the scenario whose releases to evaluate")
    if max_tokens is not None and max_tokens < 1:
        raise ConfigError(f"--max-tokens must be at least 1, got {max_tokens}")
    files = task_files(tasks)
    sets = task_sets(files)
    verifier, options = cfg.learn.verifier, dict(cfg.learn.verifier_options)
    verify = make_verifier(verifier, options)
    check_verifier_fields(verifier, options, files)
    pm = get_plugin_manager()
    kind, binding = release_kind(cfg, scenario, pm)
    generation = EvalGeneration.from_options(binding.evaluation.options.get("generation"))
    if max_tokens is not None:
        generation = dataclasses.replace(generation, max_tokens=max_tokens)
    store = pm.create("artifact_store", cfg.storage.artifact_store, config=cfg.storage,
                      data_dir=Path(cfg.storage.data_dir))
    chain = [r for r in reversed(store.releases(scenario)) if r.state == "chain"]
    if not chain:
        known = ", ".join(repr(s) for s in store.scenarios()[:20]) or "none"
        raise ConfigError(f"--scenario {scenario!r}: no releases in {cfg.storage.data_dir} (scenarios with "
                          f"releases: {known})")
    kept, pruned = select(chain, scenario, first, last, last_n)
    runner = release_runner(cfg, kind, binding.config.surface_options, generation,
                            cfg.learn.max_tokens or cfg.engine.max_new_tokens, pm)
    rows, by_content, failed_loads = [], {}, 0
    per_release = sum(len(t) for t in sets.values())
    skipped = [{**_row(i, r), "reason": "pruned: its weights were garbage-collected (reef gc)"} for i, r in pruned]
    try:
        for _, release in kept:  # what cannot be served is refused before the model loads
            runner.check(release, lambda release=release: store.read_files(release.release_id))
        with Progress(f"reef eval: scoring {len(kept)} releases of {scenario}", len(kept) * per_release,
                      unit="episode") as bar:
            for index, release in kept:
                row = _row(index, release)
                earlier = by_content.get(release.content_id)
                if earlier is not None:  # a rollback or restore: the same files score the same (greedy, seeded)
                    rows.append({**row, **{k: earlier[k] for k in ("scores", "episodes", "failed", "errors", "error")},
                                 "same_content_as": earlier["release_id"]})
                    bar.advance(per_release)
                    continue
                try:
                    files_of = store.read_files(release.release_id)
                except Conflict as exc:  # pruned since it was listed
                    skipped.append({**row, "reason": exc.message})
                    bar.advance(per_release)
                    continue
                reply = runner.prepare(release.release_id, release.content_id, files_of)
                row.update(_score(reply, sets, verify, bar.advance), same_content_as=None)
                failed_loads += row["error"] is not None
                rows.append(row)
                by_content[release.content_id] = row
    finally:
        runner.close()
    document = _document(cfg, scenario, kind, files, sets, verifier, options, generation,
                         {"from": first, "to": last, "last": last_n}, rows, skipped)
    if save:
        document["path"] = str(save_run(cfg.storage.data_dir, document))
    print(json.dumps(document, indent=2))
    return 1 if failed_loads else 0


def _document(cfg, scenario, kind, files, sets, verifier, options, generation, selection, rows, skipped) -> dict:
    digest = hashlib.sha256("".join(f"{f.label}\0{f.sha256}\n" for f in files).encode()).hexdigest()
    return {
        "format": FORMAT, "scenario": scenario, "kind": kind, "created_at": _now(), "tasks_digest": digest,
        "task_files": [{"set": f.label, "file": str(f.path), "sha256": f.sha256, "tasks": len(f.tasks)}
                       for f in files],
        "sets": {name: len(tasks) for name, tasks in sets.items()},
        "verifier": {"name": verifier, "options": options},
        "generation": {**dataclasses.asdict(generation),
                       "max_tokens": generation.max_tokens or cfg.learn.max_tokens or cfg.engine.max_new_tokens},
        "engine": {"kind": cfg.engine.kind, "model": cfg.engine.model}, "selection": selection,
        "releases": rows, "skipped": skipped, "forgetting": forgetting(rows, list(sets)),
    }
