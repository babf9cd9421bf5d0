"""Building samples: one inference (or several, as one multi-turn trajectory) plus its reward.

Merging several exchanges (a report quoting the receipts of one agent run, in reference order): clients resend the
whole history with every request, so a later request already contains the earlier turns and the earlier assistant
replies. The trajectory grows by the *new* part of each request only; each reply becomes an assistant turn tagged
with the record and version that produced it (a :class:`~reef_core.observe.processor.Segment`). The result for a
well-behaved client is the last request's messages plus the last reply, with every earlier reply found in place.

When a request does not extend the trajectory built so far (the client rewrote or compacted its history, or quoted
an unrelated exchange), the request's messages are appended whole and the turn's ``context_start`` points at them,
so every turn still records exactly the prompt its model saw; ``metadata["reef"]["contiguous"]`` is then False.
"""

from __future__ import annotations

from collections.abc import Sequence

from reef_core.observe.model import Record
from reef_core.observe.processor import Sample, Segment
from reef_core.observe.processors.conversation import common_prefix, exchange_of, tokens_of


def merge_exchanges(records: Sequence[Record]) -> tuple[list[dict], list[Segment], bool]:
    """``(messages, segments, contiguous)`` of the trajectory formed by ``records`` in order.

    Raises :class:`~reef_core.observe.processors.conversation.UnusableRecord` for a record without a chat exchange.
    """
    if not records:
        raise ValueError("a trajectory needs at least one inference record")
    trajectory: list[dict] = []
    segments: list[Segment] = []
    contiguous = True
    run_start = 0  # where the history the current turns share begins
    for record in records:
        messages, reply = exchange_of(record)
        history = trajectory[run_start:]
        shared = common_prefix(history, messages)
        if segments and shared < len(history):
            # The request does not extend the trajectory: start a new run holding its whole prompt.
            contiguous = False
            run_start = len(trajectory)
            trajectory.extend(messages)
        else:
            trajectory.extend(messages[shared:])
        trajectory.append(reply)
        segments.append(Segment(message_index=len(trajectory) - 1, record_id=record.record_id,
                                version=record.version, context_start=run_start, tokens=tokens_of(record)))
    return trajectory, segments, contiguous


def trajectory_sample(scenario: str, inferences: Sequence[Record], *, reward: float | None, feedback=None,
                      metadata: dict | None = None, report_id: str | None = None,
                      group_key: str | None = None, extra: dict | None = None) -> Sample:
    """A sample of ``inferences`` (merged as above) with its reward and provenance.

    ``metadata`` is the report's metadata; Reef's own bookkeeping goes under ``metadata["reef"]`` (the sessions
    tags, whether the trajectory is contiguous, and ``extra``).
    """
    messages, segments, contiguous = merge_exchanges(inferences)
    meta = dict(metadata or {})
    reef = {"contiguous": contiguous, "turns": len(segments)}
    sessions = sorted({str(r.tags["session"]) for r in inferences if "session" in r.tags})
    if sessions:
        reef["sessions"] = sessions
    reef.update(extra or {})
    meta["reef"] = reef
    source_ids = [r.record_id for r in inferences] + ([report_id] if report_id else [])
    return Sample(scenario=scenario, messages=messages, segments=segments, reward=reward, feedback=feedback,
                  metadata=meta, source_ids=source_ids, report_id=report_id, group_key=group_key)
