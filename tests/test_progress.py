"""Progress lines of long work (reef_core.progress) away from a terminal."""

from __future__ import annotations

import io
import logging

from reef_core.progress import Progress


def test_counted_work_prints_a_line_per_tenth_and_the_end():
    out = io.StringIO()
    with Progress("importing", 10_000, unit="record", stream=out) as bar:
        for _ in range(1000):
            bar.advance(10)
    lines = out.getvalue().splitlines()
    assert lines == [f"importing: {k * 1000}/10000 records" for k in range(1, 11)]


def test_uneven_steps_and_an_unknown_total():
    out = io.StringIO()
    with Progress("reef sweep", 3, unit="job", stream=out) as bar:
        bar.advance(2)
        bar.advance(0)  # nothing done: no line
        bar.advance(1)
    assert out.getvalue().splitlines() == ["reef sweep: 2/3 jobs", "reef sweep: 3/3 jobs"]
    out = io.StringIO()
    with Progress("scan", None, stream=out) as bar:
        bar.advance(1)
        bar.advance(1)
    assert out.getvalue().splitlines() == ["scan: 1 items", "scan: 2 items"]


def test_stages_are_named_and_counted_to_a_logger(caplog):
    log = logging.getLogger("reef.test.progress")
    with caplog.at_level(logging.INFO, logger=log.name):
        with Progress("converting", 3, unit="stage", logger=log) as bar:
            for name in ("tokenizer", "dequantize", "save"):
                bar.stage(name)
    assert [r.getMessage() for r in caplog.records] == [
        "converting: 0/3 stages (tokenizer)", "converting: 1/3 stages (dequantize)", "converting: 2/3 stages (save)"]
    assert bar.done == 3


def test_a_failed_stage_is_not_counted():
    out = io.StringIO()
    try:
        with Progress("converting", 2, unit="stage", stream=out) as bar:
            bar.stage("tokenizer")
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert bar.done == 0
