"""Every benchmark either runs the real `reef serve` or names the one that measures its path through it (#41)."""

from __future__ import annotations

import pytest

from bench import __main__ as bench_main


def test_every_benchmark_says_how_it_meets_reef_serve():
    assert set(bench_main.THROUGH_SERVER) == set(bench_main.BENCHMARKS)


@pytest.mark.parametrize("name", [n for n, via in bench_main.THROUGH_SERVER.items() if via])
def test_a_component_benchmark_names_a_through_server_one(name):
    counterpart = bench_main.THROUGH_SERVER[name].split(" ", 1)[0]
    assert counterpart in bench_main.BENCHMARKS and bench_main.THROUGH_SERVER[counterpart] is None


def test_the_help_lists_the_component_benchmarks(capsys):
    with pytest.raises(SystemExit):
        bench_main.main(["--help"])
    out = capsys.readouterr().out
    assert "measured alone" in out and "engine (stream)" in out
