"""Built-in offline tasks for ``reef sweep`` jobs."""

from __future__ import annotations

import json
from pathlib import Path

from .. import hookimpl


def dry_run(cfg, output_dir: Path) -> dict:  # cfg: the job's ReefConfig
    """Compose and validate the job's config (components resolvable, routed recipes composed with their route
    overrides and their components resolvable too), then write it resolved."""
    from ..config.recipes import check_components, recipe_bindings
    from ..plugins import get_plugin_manager

    pm = get_plugin_manager()
    if ":" in cfg.engine.kind:  # an explicit dotted path: it must import
        from ..plugins import load_object

        load_object(cfg.engine.kind)
    else:
        pm.get("engine", cfg.engine.kind)  # raises UnknownComponent with the available names
    checks, routed = {"engine": cfg.engine.kind}, {}
    for name, binding in recipe_bindings(cfg, pm).items():
        found = check_components(binding, pm)  # a ``module:Name`` path must import
        if binding.default:
            checks.update(found)
        else:
            routed[name] = {"patterns": list(binding.patterns), "components": found}
    output_dir.mkdir(parents=True, exist_ok=True)
    from ..config import as_yaml

    (output_dir / "resolved.yaml").write_text(as_yaml(cfg))
    summary = {"task": "dry_run", "recipe": cfg.recipe.name, "seed": cfg.seed, "components": checks}
    if routed:
        summary["routed_recipes"] = routed
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def learn(cfg, output_dir: Path) -> dict:
    """Run the recipe's learning loop offline on ``cfg.learn.file``; write ``metrics.json`` (one per job, so
    the jobs of a sweep compare) and return it without the per-rollout rewards."""
    from ..loop.offline import run_learning
    from ..sweep import METRICS_FILE  # here: the sweep module loads Hydra, which a serving process never needs

    output_dir.mkdir(parents=True, exist_ok=True)
    result = run_learning(cfg, output_dir)
    metrics = {"task": "learn", "recipe": cfg.recipe.name, "overrides": _job_overrides(output_dir), "seed": cfg.seed,
               "lr": cfg.trainer.lr, "task_file": cfg.learn.file, **result}
    (output_dir / METRICS_FILE).write_text(json.dumps(metrics, indent=2))
    return {k: v for k, v in metrics.items() if k not in ("rewards", "releases")}


def _job_overrides(output_dir: Path) -> list[str]:
    """The command-line overrides of this job, as Hydra saved them beside its outputs (none outside a sweep)."""
    import yaml

    try:
        found = yaml.safe_load((output_dir / ".hydra" / "overrides.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return []
    return [str(item) for item in found] if isinstance(found, list) else []



@hookimpl
def reef_register_tasks(register):
    register("dry_run", dry_run, description="validate the job's config and write it resolved")
    register("learn", learn, description="run the recipe's learning loop offline on a task file; write metrics.json")
