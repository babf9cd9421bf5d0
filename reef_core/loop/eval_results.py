"""The results of ``reef eval releases``: the forgetting metric, and the result files the dashboard reads.

A run is one JSON document (see :func:`reef_core.loop.eval_command.run_eval_releases` for its fields), kept as
``<data_dir>/evaluations/<scenario key>/<UTC time>-<tasks digest>.json``: one file per run, never rewritten, so a
reader never sees half a run and older runs stay comparable.

Forgetting (continual learning, Chaudhry et al. 2018, "Riemannian Walk for Incremental Learning"): for a task set
``k`` scored at releases ``1..T`` (oldest first), ``forgetting_k = max_{r < T} score_k(r) - score_k(T)``: how far
the set fell from the best an earlier release reached. Positive means the latest release lost ground on ``k``;
zero or less means it kept (or passed) its best. A set scored at one release only has none (None). Releases where
every episode of a set failed are left out of that set's series.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
from pathlib import Path

from ..commit.release import scenario_key

log = logging.getLogger("reef.eval")

#: The ``format`` field of a result document.
FORMAT = "reef-release-eval/1"
DIRECTORY = "evaluations"


def forgetting(rows: list[dict], sets: list[str]) -> dict:
    """Per task set: its first, best-before-last and last scores over ``rows`` (releases oldest first, each with
    ``release_id`` and ``scores``: set -> mean or None) and its forgetting; ``mean``: over the sets that have one."""
    out = {}
    for name in sets:
        series = [(row["release_id"], row["scores"][name]) for row in rows
                  if row.get("scores", {}).get(name) is not None]
        entry = {"first": None, "first_release_id": None, "best": None, "best_release_id": None, "last": None,
                 "last_release_id": None, "forgetting": None}
        if series:
            entry.update(first=series[0][1], first_release_id=series[0][0], last=series[-1][1],
                         last_release_id=series[-1][0])
        if len(series) > 1:
            best_id, best = max(series[:-1], key=lambda point: point[1])  # the earliest of equal bests
            entry.update(best=best, best_release_id=best_id, forgetting=best - series[-1][1])
        out[name] = entry
    values = [entry["forgetting"] for entry in out.values() if entry["forgetting"] is not None]
    return {"sets": out, "mean": statistics.fmean(values) if values else None}


def runs_dir(data_dir: str | os.PathLike, scenario: str) -> Path:
    return Path(data_dir) / DIRECTORY / scenario_key(scenario)


def save_run(data_dir: str | os.PathLike, document: dict) -> Path:
    """Write ``document`` as a new run file (atomically: a reader sees all of it or none); returns its path."""
    folder = runs_dir(data_dir, document["scenario"])
    folder.mkdir(parents=True, exist_ok=True)
    stamp = document["created_at"].replace("-", "").replace(":", "").replace(".", "")
    path = folder / f"{stamp}-{document['tasks_digest'][:12]}.json"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".run-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(document, fh, indent=1, sort_keys=True)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_runs(data_dir: str | os.PathLike, scenario: str, limit: int) -> list[dict]:
    """The scenario's last ``limit`` runs, newest first; a file that is not a run document is skipped (logged),
    never an error for the reader."""
    folder = runs_dir(data_dir, scenario)
    if not folder.is_dir():
        return []
    runs = []
    for path in sorted(folder.glob("*.json"), reverse=True):
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            log.warning("skipping evaluation file %s: %s", path, exc)
            continue
        if not (isinstance(document, dict) and document.get("format") == FORMAT
                and document.get("scenario") == scenario and isinstance(document.get("releases"), list)):
            log.warning("skipping evaluation file %s: not a %s document of scenario %r", path, FORMAT, scenario)
            continue
        runs.append(document)
        if len(runs) == limit:
            break
    return runs
