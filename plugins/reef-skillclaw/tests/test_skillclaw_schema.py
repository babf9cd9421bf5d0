"""The skillclaw report schema: task, category, receipts, and a score or the unscored sentinel."""

from __future__ import annotations

import pytest

from reef_core.api import ValidationFailed
from reef_skillclaw.schema import validate_report

META = {"task": "deploy-1", "category": "deploy"}


def test_scored_and_unscored_reports_pass():
    assert validate_report({"score": 1, "references": ["r1", "r2"], "metadata": META})
    assert validate_report({"references": ["r1"], "metadata": {**META, "unscored": True}})


@pytest.mark.parametrize("report, needle", [
    ({"score": 1, "references": [], "metadata": META}, "every receipt"),
    ({"score": 1, "references": ["r"], "metadata": {"category": "c"}}, "metadata.task"),
    ({"score": 1, "references": ["r"], "metadata": {"task": "t", "category": ""}}, "metadata.category"),
    ({"references": ["r"], "metadata": META}, "score is missing"),
    ({"score": 1.5, "references": ["r"], "metadata": META}, r"\[0, 1\]"),
    ({"score": -1.0, "references": ["r"], "metadata": META}, r"\[0, 1\]"),
])
def test_bad_reports_are_refused(report, needle):
    with pytest.raises(ValidationFailed, match=needle):
        validate_report(report)
