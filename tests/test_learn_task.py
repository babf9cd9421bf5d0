"""The pieces of ``reef sweep ... task=learn`` that need no model: task files, verifiers, the reward curve, the task
order and the summary table (the whole loop runs in plugins/reef-sao/tests/test_sao_sweep_learn.py)."""

from __future__ import annotations

import json

import pytest

from reef_core.errors import ConfigError
from reef_core.config import compose_config
from reef_core.loop.offline import _task_order, reward_curve, run_learning
from reef_core.loop.taskfile import load_tasks, make_verifier
from reef_core.sweep import collect_metrics, format_table


def write(tmp_path, *lines):
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_task_file_lines_become_chats_with_their_fields(tmp_path):
    spec = write(tmp_path, json.dumps({"prompt": "2+2?", "expected": "4"}), "",
                 json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "hi"}], "pattern": "^h"}))
    first, second = load_tasks(spec)
    assert first["messages"] == [{"role": "user", "content": "2+2?"}] and first["expected"] == "4"
    assert [m["role"] for m in second["messages"]] == ["system", "user"] and second["pattern"] == "^h"


@pytest.mark.parametrize("line, named", [
    ("not json", "line 2: not JSON"),
    ("[1, 2]", "line 2: a task must be a JSON object"),
    ('{"expected": "4"}', "line 2: a task needs 'messages' or a non-empty 'prompt'"),
    ('{"messages": [{"content": "x"}]}', "line 2: 'messages' must be"),
    ('{"messages": []}', "line 2: 'messages' must be"),
])
def test_a_bad_task_line_is_a_config_error_naming_its_line(tmp_path, line, named):
    with pytest.raises(ConfigError, match=named):
        load_tasks(write(tmp_path, '{"prompt": "ok"}', line))


def test_task_file_must_exist_and_hold_a_task(tmp_path):
    with pytest.raises(ConfigError, match="learn.file is not set"):
        load_tasks(None)
    with pytest.raises(ConfigError, match="is not a file"):
        load_tasks(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="holds no task"):
        load_tasks(write(tmp_path, ""))
    with pytest.raises(ConfigError, match="no installed package"):
        load_tasks("pkg://no_such_package_xyz/tasks.jsonl")
    with pytest.raises(ConfigError, match="pkg://<package>/<path>"):
        load_tasks("pkg://reef_core")


def test_a_packaged_task_file_is_found_by_pkg_url():
    with pytest.raises(ConfigError, match="not JSON"):  # found inside the package, then parsed as JSONL
        load_tasks("pkg://reef_core/conf/config.yaml")


def test_verifiers_are_the_gates_scorers():
    assert make_verifier("exact_match", {})(" 4 ", {"expected": "4"}) == 1.0
    assert make_verifier("regex", {"fullmatch": True})("aei", {"pattern": "[aeiou]+"}) == 1.0
    assert make_verifier("python", {"path": "builtins:len"}) is not None
    with pytest.raises(ConfigError, match="learn.verifier must be one of"):
        make_verifier("nope", {})
    with pytest.raises(ConfigError, match="do not fit verifier 'exact_match'"):
        make_verifier("exact_match", {"bogus": 1})


def test_reward_curve_is_the_mean_per_window():
    curve = reward_curve([0.0, 1.0, 1.0, 1.0, 0.5], window=2)
    assert curve["reward_curve"] == [0.5, 1.0, 0.5]
    assert curve["first_window_mean"] == 0.5 and curve["last_window_mean"] == 0.5
    assert reward_curve([], window=4)["first_window_mean"] is None


def test_task_order_covers_the_file_per_pass_and_follows_the_seed():
    order = _task_order(5, 12, seed=0)
    assert len(order) == 12 and sorted(order[:5]) == list(range(5)) and sorted(order[5:10]) == list(range(5))
    assert order == _task_order(5, 12, seed=0) and order != _task_order(5, 12, seed=1)


def test_summary_table_has_a_row_per_job_naming_the_swept_overrides(tmp_path):
    for job, (lr, seed, first, last) in enumerate([("1e-4", 0, 0.2, 0.3), ("1e-4", 1, 0.25, 0.2),
                                                   ("3e-4", 0, 0.2, 0.6), ("3e-4", 1, 0.3, 0.7)]):
        (tmp_path / str(job)).mkdir()
        (tmp_path / str(job) / "metrics.json").write_text(json.dumps({
            "overrides": ["+recipe=sao", f"trainer.lr={lr}", f"seed={seed}"], "first_window_mean": first,
            "last_window_mean": last, "versions_published": 3, "rejected": 0, "wall_s": 1.5}))
    (tmp_path / "10").mkdir()
    (tmp_path / "10" / "metrics.json").write_text("{broken")  # a job that died mid-write is left out
    rows = collect_metrics(tmp_path)
    assert [row["job"] for row in rows] == ["0", "1", "2", "3"]
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["job", "overrides", "first", "last", "delta", "versions", "rejected", "wall_s"]
    assert lines[3].split() == ["2", "trainer.lr=3e-4", "seed=0", "0.200", "0.600", "+0.400", "3", "0", "1.5"]
    assert all("+recipe=sao" not in line for line in lines)  # shared by every job: not a column value


@pytest.mark.parametrize("override, named", [("learn.rollouts=0", "learn.rollouts"), ("learn.window=0", "learn.window"),
                                             ("learn.step_timeout_s=0", "learn.step_timeout_s")])
def test_bad_learn_options_fail_before_anything_is_built(tmp_path, override, named):
    task_file = write(tmp_path, json.dumps({"prompt": "hi"}))
    cfg = compose_config([override, f"learn.file={task_file}"])
    with pytest.raises(ConfigError, match=named):
        run_learning(cfg, tmp_path / "job")
    assert not (tmp_path / "job").exists()
