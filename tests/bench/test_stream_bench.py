"""``python -m bench stream``'s arithmetic: the server's per-thread split (main thread, engine thread, the rest; the
process total ``top -H`` shows on the main thread's row), the rates, the composed overrides and the argument checks.
The end-to-end run (three processes on SmolLM2) is a benchmark, not a test."""

from __future__ import annotations

import argparse
import os
import time

import pytest

from bench import stream


def test_thread_split_separates_the_main_thread_from_the_busiest_other_one():
    pid = 100
    before = {100: 1.0, 101: 5.0, 102: 0.5}
    after = {100: 1.25, 101: 7.0, 102: 0.75, 103: 0.5}  # 103 started in between
    split = stream.thread_split(pid, before, after)
    assert split == pytest.approx({"main_s": 0.25, "busiest_other_s": 2.0, "rest_s": 0.75, "total_s": 3.0})


def test_thread_cpu_charges_the_main_thread_with_its_own_work_only():
    if not os.path.isdir(f"/proc/{os.getpid()}/task"):
        pytest.skip("no /proc")
    before = stream.thread_cpu(os.getpid())
    start = time.thread_time()
    while time.thread_time() - start < 0.2:  # 0.2 s of this thread's CPU, however loaded the machine is
        pass
    after = stream.thread_cpu(os.getpid())
    split = stream.thread_split(os.getpid(), before, after)
    assert split["main_s"] >= 0.15 and split["busiest_other_s"] < 0.1


def test_rates_are_per_request_and_over_the_whole_run():
    got = stream.rates([{"tokens": 128, "s": 2.0, "cpu_s": 1.5}, {"tokens": 128, "s": 4.0, "cpu_s": 1.7},
                        {"tokens": 128, "s": 1.0, "cpu_s": 1.6}])
    assert got["tokens"] == 128
    assert got["tok_s_median"] == pytest.approx(64.0) and got["tok_s_best"] == pytest.approx(128.0)
    assert got["tok_s_total"] == pytest.approx(384 / 7.0) and got["cpu_s_median"] == pytest.approx(1.6)


def test_the_served_engine_is_composed_like_reef_serve():
    assert stream.recipe_overrides("smollm2", ["engine.num_threads=2"]) == [
        "+recipe=sao", "engine.model=smollm2", "engine.num_threads=2"]
    assert stream.recipe_overrides("tiny", []) == ["+recipe=sao", "+sao_profile=tiny"]


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--tokens", "0"], ["--threads", "0"]])
def test_bad_arguments_are_refused_before_anything_starts(argv):
    parser = argparse.ArgumentParser()
    stream.add_arguments(parser)
    with pytest.raises(SystemExit):
        stream.run(parser.parse_args(argv))
