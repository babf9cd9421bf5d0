"""``reef gc``: apply the retention policy of ``storage.retention`` to the artifact store."""

from __future__ import annotations

import json
from pathlib import Path

from ..progress import Progress
from .retention import RetentionPolicy, plan_gc, run_gc


def run_gc_command(cfg, *, dry_run: bool) -> int:
    from ..plugins import get_plugin_manager

    store = get_plugin_manager().create("artifact_store", cfg.storage.artifact_store, config=cfg.storage,
                                        data_dir=Path(cfg.storage.data_dir))
    retention = cfg.storage.retention
    policy = RetentionPolicy(keep_last=int(retention.keep_last), keep_ever_current=bool(retention.keep_ever_current),
                             pinned=frozenset(retention.pinned))
    plan = plan_gc(store, policy)
    if dry_run:
        result = run_gc(store, plan, dry_run=True)
    else:
        with Progress("reef gc: deleting LFS objects", len(plan.delete_objects), unit="object") as bar:
            result = run_gc(store, plan, dry_run=False, advance=bar.advance)
    report = {
        "dry_run": dry_run,
        "policy": {"keep_last": policy.keep_last, "keep_ever_current": policy.keep_ever_current,
                   "pinned": sorted(policy.pinned)},
        "would_prune_releases" if dry_run else "pruned_releases": result.pruned_releases,
        "would_delete_objects" if dry_run else "deleted_objects": result.deleted_objects,
        "reclaimed_bytes": result.reclaimed_bytes,
        "retained": {release: plan.reasons.get(release, "") for release in plan.retained},
    }
    print(json.dumps(report, indent=2))
    return 0
