"""``reef sweep``: Hydra multirun over offline tasks, built on ``@hydra.main``.

Each job composes the same typed config as ``reef serve`` and runs the registered task named
by ``task`` (default ``dry_run``), writing its outputs to the job's Hydra output directory. After a
multirun, :class:`SummaryTable` (a Hydra callback named in the primary config) prints one row per job
that wrote a ``metrics.json`` (the ``learn`` task), so the jobs of a sweep compare at a glance.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback

from .config.compose import CONFIG_NAME, CONFIG_MODULE, searchpath_override, to_plain
from .config.schema import register_schema
from .progress import Progress


@hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME)
def _job(cfg) -> None:
    from .plugins import get_plugin_manager

    output_dir = Path(HydraConfig.get().runtime.output_dir)
    plain = to_plain(cfg)  # tasks get the same typed, plain config as ``reef serve``
    summary = get_plugin_manager().create("task", plain.task, cfg=plain, output_dir=output_dir)
    print(json.dumps({"output_dir": str(output_dir), **(summary or {})}))


def run_sweep(args: list[str]) -> int:
    from .plugins import get_plugin_manager

    register_schema()
    argv0 = sys.argv[0]
    sys.argv = ["reef sweep", *args, *searchpath_override(get_plugin_manager())]
    try:
        _job()
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        sys.argv[0] = argv0
    return 0


class SummaryTable(Callback):
    """Hydra callback of ``reef sweep``: progress over the jobs of a multirun (stderr), then the ``metrics.json``
    of each job as one table row."""

    def __init__(self) -> None:
        self._progress: Progress | None = None

    def on_multirun_start(self, config, **kwargs) -> None:
        self._progress = Progress("reef sweep", sweep_size(list(config.hydra.overrides.task)), unit="job")

    def on_job_end(self, config, job_return, **kwargs) -> None:
        if self._progress is not None:
            status = getattr(getattr(job_return, "status", None), "name", "?").lower()
            self._progress.note = f"job {config.hydra.job.num} {status}"
            self._progress.advance(1)

    def on_multirun_end(self, config, **kwargs) -> None:
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        rows = collect_metrics(Path(str(config.hydra.sweep.dir)))
        if rows:
            print(format_table(rows), flush=True)


def sweep_size(overrides: list[str]) -> int | None:
    """How many jobs the basic sweeper makes of ``overrides`` (the product of the swept lists); None when a sweep
    is not a plain list (a range or interval the progress cannot count ahead)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # Hydra itself reports a malformed override; the count is only for progress
        return None
    total = 1
    for override in parsed:
        if override.is_sweep_override():
            if not override.is_discrete_sweep():
                return None
            total *= len(list(override.sweep_string_iterator()))
    return total


#: The file a ``learn`` job writes in its output directory (read back here for the summary table).
METRICS_FILE = "metrics.json"


def collect_metrics(sweep_dir: Path) -> list[dict]:
    """The metrics of each job directory under ``sweep_dir``, in job order (unreadable files skipped)."""
    rows = []
    for path in sweep_dir.glob(f"*/{METRICS_FILE}"):
        try:
            metrics = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(metrics, dict):
            rows.append({"job": path.parent.name, **metrics})
    return sorted(rows, key=lambda row: (not row["job"].isdigit(), int(row["job"]) if row["job"].isdigit() else 0,
                                         row["job"]))


def format_table(rows: list[dict]) -> str:
    """One line per job: the overrides that differ between jobs, then the reward and publication columns."""
    varying = _varying_overrides(rows)
    columns = ["job", "overrides", "first", "last", "delta", "versions", "rejected", "wall_s"]
    lines = []
    for row in rows:
        first, last = row.get("first_window_mean"), row.get("last_window_mean")
        delta = last - first if isinstance(first, (int, float)) and isinstance(last, (int, float)) else None
        lines.append([row["job"], " ".join(o for o in row.get("overrides", []) if o in varying) or "-",
                      _num(first), _num(last), _num(delta, signed=True), str(row.get("versions_published", "-")),
                      str(row.get("rejected", "-")), _num(row.get("wall_s"), digits=1)])
    widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(columns)]
    out = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    out += ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join(out)


def _varying_overrides(rows: list[dict]) -> set[str]:
    """Overrides not shared by every job (the swept ones); all of them for a single job."""
    sets = [set(row.get("overrides") or []) for row in rows]
    if len(sets) < 2:
        return set().union(*sets) if sets else set()
    return set().union(*sets) - set.intersection(*sets)


def _num(value, *, digits: int = 3, signed: bool = False) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"
