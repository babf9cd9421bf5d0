"""The answer to a read of a body that record retention compacted: ``410`` naming when and why."""

from __future__ import annotations

import time

from reef_core.errors import Gone
from reef_core.observe.compacted import compaction_of
from reef_core.observe.model import Record


def compacted_error(record: Record, marker: dict | None = None) -> Gone:
    """410: the body of ``record`` was compacted (when and why named); its metadata stays readable."""
    marker = marker or compaction_of(record) or {}
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(marker.get("at", 0))))
    return Gone(f"the body of record {record.record_id!r} was compacted by record retention at {at} "
                f"(reason: {marker.get('reason')}); its metadata stays at "
                f"/reef/scenarios/{record.scenario}/records/{record.record_id}/metadata",
                compacted_at=marker.get("at"), reason=marker.get("reason"))


def refuse_compacted(record: Record | None) -> None:
    """Raise the 410 when ``record`` is compacted (a retry that would replay it, a previous response)."""
    if record is not None:
        marker = compaction_of(record)
        if marker is not None:
            raise compacted_error(record, marker)
