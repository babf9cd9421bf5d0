"""Crash points for recovery tests: ``REEF_CRASH_AT=<name>`` kills the process at that point.

The process exits at once with status 137 (as if SIGKILLed): no ``finally`` blocks, no flushes,
so a test can check that every gap in the write order recovers to a consistent state.
Points: ``after_stage`` (release written, no commit-log row), ``after_log`` (row committed,
head not moved), ``after_head`` (head moved, batch not yet acknowledged in the record store).
"""

from __future__ import annotations

import os

ENV = "REEF_CRASH_AT"


def crash_point(name: str) -> None:
    if os.environ.get(ENV) == name:
        os._exit(137)
