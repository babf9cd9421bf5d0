"""``reef eval releases`` without a model: harness releases answered by the fake provider (a private upstream client),
the range options, the refusals at the door, and the forgetting metric. The weights path on a real SAO scenario
is tests/serve/test_eval_releases_sao.py."""

from __future__ import annotations

import json

import pytest

from reef_core.cli import main
from reef_core.commit.git_store import GitArtifactStore
from reef_core.loop.eval_results import forgetting, load_runs
from reef_core.testing.chain import publish, rollback

SCENARIO = "harn"


def write_tasks(path, *tasks) -> str:
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return str(path)


@pytest.fixture
def chain(tmp_path):
    """A harness scenario of five releases (system prompts "step 0" .. "step 3", then a rollback to "step 1")."""
    store = GitArtifactStore(tmp_path / "data" / "artifacts.git", tmp_path / "data" / "artifacts-work")
    head, ids = None, []
    for step in range(4):
        head = publish(store, SCENARIO, {"system_prompt.md": f"step {step}".encode()},
                       expected_parent=head and head.release_id, operation="creation" if step == 0 else "training")
        ids.append(head.release_id)
    ids.append(rollback(store, SCENARIO, ids[1], expected_head=ids[-1]).release_id)
    return store, ids


@pytest.fixture
def run(tmp_path, fake_upstream_url, capsys):
    """``reef eval releases`` in process on the fixture's data dir: (exit code, result document or None, stderr)."""
    def go(*args: str, overrides: tuple[str, ...] = ()):
        code = main(["eval", "releases", "--scenario", SCENARIO, *args, f"storage.data_dir={tmp_path}/data",
                     "engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}", "recipe.name=h",
                     "recipe.surface=harness", *overrides])
        out, err = capsys.readouterr()
        return code, (json.loads(out) if out.strip() else None), err
    return go


@pytest.fixture
def tasks(tmp_path):
    # The fake provider answers "echo: <last user text>": one task it passes, one it fails (mean 0.5 a release).
    return write_tasks(tmp_path / "held.jsonl", {"prompt": "hi", "expected": "echo: hi"},
                       {"prompt": "yo", "expected": "no"})


def test_every_release_is_scored_in_chain_order_with_its_own_system_prompt(chain, run, tasks, upstream, tmp_path):
    store, ids = chain
    before = [(r.release_id, r.current) for r in store.releases(SCENARIO)]
    code, doc, _ = run("--tasks", tasks)
    assert code == 0
    assert [row["release_id"] for row in doc["releases"]] == ids
    assert [row["index"] for row in doc["releases"]] == [0, 1, 2, 3, 4]
    assert [row["operation"] for row in doc["releases"]] == ["creation", "training", "training", "training",
                                                             "rollback"]
    assert all(row["scores"] == {"held": 0.5} and row["episodes"] == {"held": 2} for row in doc["releases"])
    assert doc["releases"][-1]["current"] and doc["releases"][-1]["same_content_as"] == ids[1]
    # Each release's own system prompt reached the provider, in chain order; the rollback's content was not
    # asked again (its scores are its twin's).
    systems = [r["body"]["messages"][0]["content"] for r in upstream.requests()]
    assert systems == [f"step {i}" for i in range(4) for _ in range(2)]
    assert all(r["body"]["temperature"] == 0 for r in upstream.requests())
    # Nothing recorded: no record store, the chain as it was; the run is kept for the dashboard.
    assert not (tmp_path / "data" / "records.db").exists()
    assert [(r.release_id, r.current) for r in store.releases(SCENARIO)] == before
    assert load_runs(tmp_path / "data", SCENARIO, 5) == [{k: v for k, v in doc.items() if k != "path"}]
    assert doc["path"].startswith(str(tmp_path / "data" / "evaluations"))


def test_several_task_sets_and_tagged_tasks_get_a_score_and_a_forgetting_each(chain, run, tmp_path, upstream):
    first = write_tasks(tmp_path / "a.jsonl", {"prompt": "hi", "expected": "echo: hi"},
                        {"prompt": "x", "expected": "echo: x", "set": "tagged"})
    second = write_tasks(tmp_path / "b.jsonl", {"prompt": "yo", "expected": "no"})
    code, doc, _ = run("--tasks", first, "--tasks", f"other={second}", "--no-save")
    assert code == 0 and "path" not in doc
    assert doc["sets"] == {"a": 1, "tagged": 1, "other": 1}
    assert doc["releases"][0]["scores"] == {"a": 1.0, "tagged": 1.0, "other": 0.0}
    assert set(doc["forgetting"]["sets"]) == {"a", "tagged", "other"}
    assert doc["forgetting"]["sets"]["other"]["forgetting"] == 0.0
    assert load_runs(tmp_path / "data", SCENARIO, 5) == []  # --no-save


def test_the_range_options_pick_part_of_the_chain(chain, run, tasks, upstream):
    _, ids = chain
    code, doc, _ = run("--tasks", tasks, "--from", ids[1][:8], "--to", ids[3], "--no-save")
    assert code == 0 and [row["release_id"] for row in doc["releases"]] == ids[1:4]
    assert [row["index"] for row in doc["releases"]] == [1, 2, 3]
    code, doc, _ = run("--tasks", tasks, "--last", "2", "--no-save")
    assert code == 0 and [row["release_id"] for row in doc["releases"]] == ids[3:]
    assert doc["selection"] == {"from": None, "to": None, "last": 2}
    # A rollback evaluated without its twin is scored itself.
    assert doc["releases"][1]["same_content_as"] is None and doc["releases"][1]["scores"] == {"held": 0.5}


def test_pruned_releases_are_listed_as_skipped(chain, run, tasks, upstream):
    store, ids = chain
    store.mark_pruned([ids[2]])
    code, doc, _ = run("--tasks", tasks, "--no-save")
    assert code == 0
    assert [row["release_id"] for row in doc["releases"]] == ids[:2] + ids[3:]
    assert [(s["release_id"], s["index"]) for s in doc["skipped"]] == [(ids[2], 2)]
    assert "pruned" in doc["skipped"][0]["reason"]


@pytest.mark.parametrize("args, overrides, message", [
    (["--scenario", "nope"], (), "--scenario 'nope': no releases"),
    (["--from", "zzz"], (), "--from 'zzz': a release id is 7 to 40 hex digits"),
    (["--to", "0000000"], (), "--to '0000000': no release of scenario 'harn'"),
    (["--last", "0"], (), "--last must be at least 1"),
    (["--last", "2", "--from", "0000000"], (), "--last cannot be combined with --from or --to"),
    (["--max-tokens", "0"], (), "--max-tokens must be at least 1"),
    ([], ("recipe.surface=skills",), "serves 'skills' releases; reef eval releases evaluates weights and harness"),
    ([], ("recipe.surface=null",), "serves no surface"),
    ([], ("recipe.surface=weights",), "weights releases needs engine.kind=local"),
    ([], ("learn.verifier=regex",), "held.jsonl task 1: no 'pattern' field, which learn.verifier=regex reads"),
    ([], ("learn.verifier=python",), "learn.verifier_options do not fit verifier 'python'"),
])
def test_bad_arguments_are_refused_naming_them(chain, run, tasks, args, overrides, message):
    code, doc, err = run("--tasks", tasks, *args, overrides=overrides)
    assert code == 2 and doc is None
    assert err.strip().splitlines() == [f"reef: error: {err.strip().removeprefix('reef: error: ')}"]
    assert message in err


def test_bad_task_files_are_refused_naming_them(chain, run, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "ok"}\nnot json\n')
    for spec, message in [(str(empty), "--tasks '" + str(empty) + "' holds no task"),
                          (str(broken), "--tasks: broken.jsonl line 2: not JSON"),
                          (str(tmp_path / "missing.jsonl"), "is not a file"),
                          (f"x={empty}", "holds no task")]:
        code, doc, err = run("--tasks", spec)
        assert code == 2 and doc is None and message in err, err
    ok = write_tasks(tmp_path / "same.jsonl", {"prompt": "hi", "expected": "x"})
    code, _, err = run("--tasks", ok, "--tasks", ok)
    assert code == 2 and "two task files are named 'same'" in err
    bad_set = write_tasks(tmp_path / "tag.jsonl", {"prompt": "hi", "expected": "x", "set": "a b"})
    code, _, err = run("--tasks", bad_set)
    assert code == 2 and "tag.jsonl task 1: 'set' must be" in err


def test_forgetting_is_the_best_earlier_score_minus_the_last():
    rows = [{"release_id": "r0", "scores": {"a": 0.2, "b": 0.9, "c": None}},
            {"release_id": "r1", "scores": {"a": 0.8, "b": None, "c": None}},
            {"release_id": "r2", "scores": {"a": 0.5, "b": 0.4, "c": 0.3}},
            {"release_id": "r3", "scores": {"a": 0.6, "b": 0.95, "c": None}}]
    out = forgetting(rows, ["a", "b", "c"])
    a, b, c = (out["sets"][k] for k in "abc")
    assert (a["first"], a["best"], a["best_release_id"], a["last"]) == (0.2, 0.8, "r1", 0.6)
    assert a["forgetting"] == pytest.approx(0.2)  # fell from r1's 0.8 to 0.6
    assert b["best_release_id"] == "r0" and b["forgetting"] == pytest.approx(-0.05)  # passed its best: negative
    assert c["first"] == c["last"] == 0.3 and c["forgetting"] is None  # scored at one release only
    assert out["mean"] == pytest.approx((0.2 - 0.05) / 2)
    ties = forgetting([{"release_id": f"r{i}", "scores": {"a": 1.0}} for i in range(3)], ["a"])
    assert ties["sets"]["a"]["best_release_id"] == "r0" and ties["sets"]["a"]["forgetting"] == 0.0
    assert forgetting([], ["a"]) == {"sets": {"a": {k: None for k in a}}, "mean": None}
