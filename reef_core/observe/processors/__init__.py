"""Built-in processors and the pieces they share (see :mod:`reef_core.observe.processor` for the contract).

* :class:`PerReportProcessor`: one sample per report (several receipts = one multi-turn trajectory);
* :class:`GroupedProcessor`: samples released in complete groups sharing a key (prompt, task...);
* :class:`GridProcessor`: a whole-step barrier, a step of G groups x R rollouts trains only when complete;
* :class:`NextStateProcessor`: no reports; each turn is judged by the next request of its conversation.

Shared: :func:`conversation_of` (dialect-free messages of a record), the staleness rules (:mod:`.eligibility`, over
the version grammar of :mod:`reef_core.versions`: :func:`parse_version`), trajectory merging (:mod:`.samples`).
"""

from reef_core.observe.processors.conversation import UnusableRecord, conversation_of, exchange_of
from reef_core.observe.processors.eligibility import StalenessPolicy, staleness_reason
from reef_core.observe.processors.grid import GridProcessor
from reef_core.observe.processors.grouped import GroupedProcessor
from reef_core.observe.processors.next_state import NextStateProcessor
from reef_core.observe.processors.per_report import PerReportProcessor, ReportedProcessor
from reef_core.observe.processors.samples import merge_exchanges, trajectory_sample
from reef_core.versions import format_version, parse_version

__all__ = [
    "GridProcessor",
    "GroupedProcessor",
    "NextStateProcessor",
    "PerReportProcessor",
    "ReportedProcessor",
    "StalenessPolicy",
    "UnusableRecord",
    "conversation_of",
    "exchange_of",
    "format_version",
    "merge_exchanges",
    "parse_version",
    "staleness_reason",
    "trajectory_sample",
]
