"""``reef gc --records [--dry-run] [--scenario S]``: one retention pass over the record store, all of it (no
``max_records_per_pass`` bound), printing what it compacted (or would) by scenario and reason."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError
from ..observe.records import RecordStore
from ..progress import Progress
from .record_retention import retention_pass


def run_records_gc_command(cfg, *, dry_run: bool, scenario: str | None) -> int:
    options = {"schema": cfg.storage.records_schema} if cfg.storage.records_schema else {}
    store = RecordStore.open(cfg.storage.records_url, Path(cfg.storage.data_dir), **options)
    try:
        names = [s.name for s in store.scenarios()]
        if scenario is not None:
            if scenario not in names:
                raise ConfigError(f"--scenario: no scenario {scenario!r} in the record store", flag="--scenario")
            names = [scenario]
        label = "reef gc --records: measuring" if dry_run else "reef gc --records: compacting"
        with Progress(label, None, unit="record") as bar:
            last = [0]

            def advance(done: int) -> None:
                bar.advance(done - last[0])
                last[0] = done

            found = retention_pass(store, cfg.storage.retention, names, dry_run=dry_run, advance=advance)
    finally:
        store.close()
    print(json.dumps(found, indent=2))
    return 0
