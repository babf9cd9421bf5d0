"""Built-in offline tasks for ``reef sweep`` jobs."""

from __future__ import annotations

import json
from pathlib import Path

from .. import hookimpl


def dry_run(cfg, output_dir: Path) -> dict:  # cfg: the job's ReefConfig
    """Compose and validate the job's config (components resolvable), then write it resolved."""
    from ..plugins import get_plugin_manager

    pm = get_plugin_manager()
    checks = {}
    recipe = cfg.recipe
    for kind, name in (("processor", recipe.processor), ("trainer", recipe.trainer),
                       ("surface", recipe.surface), ("report_schema", recipe.report_schema),
                       ("engine", cfg.engine.kind), ("selection_policy", cfg.evaluation.policy),
                       ("evaluator", cfg.evaluation.evaluator)):
        if name and ":" in name:  # an explicit dotted path: it must import
            from ..dotted import load_object

            load_object(name)
            checks[kind] = name
        elif name:
            pm.get(kind, name)  # raises UnknownComponent with the available names
            checks[kind] = name
    output_dir.mkdir(parents=True, exist_ok=True)
    from ..config import as_yaml

    (output_dir / "resolved.yaml").write_text(as_yaml(cfg))
    summary = {"task": "dry_run", "recipe": recipe.name, "seed": cfg.seed, "components": checks}
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


@hookimpl
def reef_register_tasks(register):
    register("dry_run", dry_run, description="validate the job's config and write it resolved")
