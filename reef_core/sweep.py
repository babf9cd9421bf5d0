"""``reef sweep``: Hydra multirun over offline tasks, built on ``@hydra.main``.

Each job composes the same typed config as ``reef serve`` and runs the registered task named
by ``task`` (default ``dry_run``), writing its outputs to the job's Hydra output directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from .config.compose import CONFIG_NAME, CONFIG_MODULE, searchpath_override, to_plain
from .config.schema import register_schema


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
