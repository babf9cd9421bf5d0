"""``python -m bench learn-vllm`` without a vLLM server: argument checks, the refusal (exit 2) when vLLM is not
installed, and the arithmetic of its tables. The real run (two SmolLM2 arms, minutes each) is not a test."""

from __future__ import annotations

import argparse

import pytest

from bench import __main__ as bench_main
from bench import learn_vllm
from reef_core.testing.real_vllm import INSTALL_HINT


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    learn_vllm.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_and_a_smoke_bound():
    args = _parse()
    assert args.arms == ["local", "vllm"] and args.rounds == 6 and args.round_size == 8 and args.minutes == 10
    smoke = _parse("--rounds", "1", "--minutes", "2", "--arms", "vllm,local", "trainer.lr=1e-3")
    assert (smoke.rounds, smoke.minutes, smoke.arms, smoke.overrides) == (1, 2.0, ["vllm", "local"], ["trainer.lr=1e-3"])


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--minutes", "0"], ["--round-size", "-1"],
                                  ["--arms", "local,sglang"], ["--arms", "local,local"], ["--arms", ""]])
def test_bad_bounds_and_arms_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(*argv)
    assert exc.value.code == 2


def test_without_vllm_it_refuses_with_exit_2_naming_the_install_step(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("reef_core.testing.real_vllm.vllm_python", lambda: None)
    monkeypatch.setattr("bench.common.RESULTS", tmp_path)  # nothing may be written either
    with pytest.raises(SystemExit) as exc:
        bench_main.main(["learn-vllm", "--rounds", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert INSTALL_HINT in err and "--arms local" in err
    assert not list(tmp_path.iterdir())


def test_the_embedded_arm_alone_needs_no_vllm(monkeypatch):
    monkeypatch.setattr("reef_core.testing.real_vllm.vllm_python", lambda: None)
    assert learn_vllm.refuse_without_vllm(["local"]) is None


def test_percentiles_and_decode_rate():
    assert learn_vllm.pct([]) == {"n": 0}
    assert learn_vllm.pct([30.0, 10.0, 20.0]) == {"n": 3, "p50": 20.0, "p90": 30.0, "max": 30.0}
    assert learn_vllm.pct([float(i) for i in range(1, 11)])["p90"] == 9.0
    rate = learn_vllm.decode_rate([1.5, 2.0, 2.5], 3, started=1.0)  # 2 tokens after the first in 1 s
    assert rate["decode_tok_s"] == 2.0 and rate["ttft_ms"] == 500.0 and rate["e2e_tok_s"] == 2.0
    assert "decode_tok_s" not in learn_vllm.decode_rate([1.5], 1, started=1.0)


def test_side_by_side_ratios_are_vllm_over_local():
    arms = {"local": {"decode": {"decode_tok_s": 20.0}, "publish_ms": {"n": 3, "p50": 400.0, "p90": 500.0},
                      "full_swap_ms": [100.0, 300.0]},
            "vllm": {"decode": {"decode_tok_s": 50.0}, "publish_ms": {"n": 2, "p50": 800.0, "p90": 900.0},
                     "full_swap_ms": [4000.0]}}
    rows = {row[0]: row[1:] for row in learn_vllm.side_by_side(arms)}
    assert rows["decode tok/s (1 stream)"] == [20.0, 50.0, "x2.50"]
    assert rows["LoRA publish p50 ms"] == [400.0, 800.0, "x2.00"]
    assert rows["full-weight swap ms"] == [200.0, 4000.0, "x20.00"]
    assert rows["reward gain"] == [None, None, None]
    only_local = {row[0]: row[1:] for row in learn_vllm.side_by_side({"local": arms["local"]})}
    assert only_local["decode tok/s (1 stream)"] == [20.0, None, None]


def test_the_publish_target_line_says_median_and_every_release_apart():
    arms = {"local": {"publish_ms": {"n": 5, "p50": 90.0, "p90": 180.0, "max": 400.0}},
            "vllm": {"publish_ms": {"n": 4, "p50": 70.0, "p90": 110.0, "max": 2100.0}},
            "none": {"publish_ms": {"n": 0}}}
    lines = learn_vllm.publish_target_lines(arms)
    assert len(lines) == 2
    assert lines[0].startswith("local:") and lines[0].endswith("target <= 1000 ms: met)")
    assert "max 2100.0 ms over 4 releases" in lines[1] and "met at the median, not by every release" in lines[1]
    slow = learn_vllm.publish_target_lines({"vllm": {"publish_ms": {"n": 1, "p50": 1500.0, "max": 1500.0}}})
    assert slow[0].endswith("NOT met)")


def test_a_round_is_settled_once_nothing_is_left_to_train():
    idle = {"learner": "idle", "processor": {"ready": False, "batch": None, "pending_units": 3}}
    assert learn_vllm.settled(idle)
    assert not learn_vllm.settled({**idle, "learner": "running"})
    assert not learn_vllm.settled({**idle, "learner": "scheduled"})
    assert not learn_vllm.settled({**idle, "processor": {"ready": True, "batch": None}})
    assert not learn_vllm.settled({**idle, "processor": {"ready": False, "batch": {"batch_id": "b", "samples": 4}}})
    assert not learn_vllm.settled({})  # the scenario does not exist yet
