"""The night's rules, one test each: digests from the recorded turns, judge only unscored sessions, the sentinel
never averaged, grouping, one JSON decision per group (unparsable -> skip, counted), no-skill bucket limits,
same-name creates merge, never remove, refused skills, retries; and the trainer around it."""

from __future__ import annotations

import json

import pytest

from reef_core.api import (
    Batch,
    ConfigError,
    Sample,
    Skill,
    TrainContext,
    UpstreamError,
    encode_tree,
    pool_files,
    render_catalog,
    validate_pool,
)
from reef_skillclaw.digest import build_digest
from reef_skillclaw.evolver import NO_SKILL, Evolver, parse_json_object
from reef_skillclaw.options import SkillClawOptions
from reef_skillclaw.prompts import STAGE_LINES
from reef_skillclaw.trainer import SkillClawTrainer

DEPLOY = Skill(slug="deploy-basics", category="deploy", body="Ship with run_task.",
               description="Ships services. Use for deploy tasks. NOT for: databases.")
POOL = {DEPLOY.slug: DEPLOY}


def session(task="deploy-1", category="deploy", score=0.0, read=None, error="error: expects setting deploy-9",
            sid=None) -> Sample:
    """A graded session as the processor hands it over: normalised turns with tool calls and results."""
    messages = [{"role": "system", "content": render_catalog(POOL)},
                {"role": "user", "content": f"[task {task}] do it"}]
    if read:
        messages += [{"role": "assistant", "content": "", "tool_calls": [
                          {"id": "c1", "type": "function",
                           "function": {"name": "read_skill", "arguments": json.dumps({"slug": read})}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "---\nname: x\n---\nbody"}]
    messages += [{"role": "assistant", "content": "", "tool_calls": [
                     {"id": "c2", "type": "function", "function": {"name": "run_task", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": "c2", "content": error},
                 {"role": "assistant", "content": "I could not finish."}]
    metadata = {"task": task, "category": category, **({"unscored": True} if score is None else {})}
    return Sample(scenario="s", messages=messages, segments=[], reward=score, metadata=metadata,
                  report_id=sid or f"rep-{task}")


class Scripted:
    """A chat model answering each stage from a script; records every call."""

    def __init__(self, **answers):
        self.answers = answers
        self.calls: list[tuple[str, str]] = []

    def __call__(self, messages):
        stage = next(s for s, line in STAGE_LINES.items() if messages[0]["content"].startswith(line))
        self.calls.append((stage, messages[1]["content"]))
        answer = self.answers.get(stage, '{"action": "skip"}')
        if isinstance(answer, list):
            answer = answer.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer(messages) if callable(answer) else answer

    def stages(self):
        return [stage for stage, _ in self.calls]


def evolver(model, **options) -> Evolver:
    opts = SkillClawOptions.from_config({"summarize": False, "retries": 2, **options})
    return Evolver(opts, decide=model, sleep=lambda s: None)


def create(name="db-settings", category="database", content="- Known setting database-1."):
    return json.dumps({"action": "create_skill", "name": name, "category": category, "content": content,
                       "description": f"Settings for {category}. Use for {category} tasks. NOT for: others."})


def test_digest_is_rebuilt_from_the_recorded_turns():
    d = build_digest(session(read="deploy-basics", score=None))
    assert (d.task, d.category, d.score, d.unscored, d.turns) == ("deploy-1", "deploy", None, True, 3)
    assert d.skills_read == ["deploy-basics"] and d.skills_offered == ["deploy-basics"]
    assert [(c.name, c.error) for c in d.tool_calls] == [("read_skill", False), ("run_task", True)]
    assert d.tool_calls[1].result == "error: expects setting deploy-9" and d.tool_error
    text = d.render()
    assert "grade: unscored" in text and "tool run_task ERROR: error: expects setting deploy-9" in text


def test_parse_json_object_accepts_exactly_one_object():
    assert parse_json_object('{"action": "skip"}') == {"action": "skip"}
    assert parse_json_object('```json\n{"action": "skip"}\n```') == {"action": "skip"}
    for bad in ["", "skip", '{"a": 1} {"b": 2}', '{"a": 1} trailing', "[1]", '{"a": ', None, 'x {"a": 1}']:
        assert parse_json_object(bad) is None, bad


def test_unparsable_decision_skips_the_group_and_is_counted():
    model = Scripted(decide="I would improve it, probably.", create="not json either")
    result = evolver(model).night([session(read="deploy-basics"), session(task="db-1", category="database")], POOL)
    assert not result.changed and result.pool == POOL
    assert result.metrics["unparsable"] == 2 and result.metrics["groups"] == 2


def test_groups_by_skill_read_plus_a_no_skill_bucket_with_a_cap():
    sessions = [session(task=f"deploy-{i}", read="deploy-basics") for i in range(4)]
    sessions += [session(task="db-1", category="database"), session(task="x-1", read="unknown-skill")]
    e = evolver(Scripted(), max_sessions_per_group=3)
    digests = [build_digest(s) for s in sessions]
    groups = e.groups(digests, POOL)
    assert [key for key, _ in groups] == ["deploy-basics", NO_SKILL]
    assert [d.task for d in groups[0][1]] == ["deploy-1", "deploy-2", "deploy-3"]  # the newest 3
    assert [d.task for d in groups[1][1]] == ["db-1", "x-1"]  # a skill not in the pool counts as none


def test_no_skill_bucket_may_only_create_or_skip():
    improve = json.dumps({"action": "improve_skill", "content": "new body"})
    model = Scripted(create=improve)
    result = evolver(model).night([session(task="db-1", category="database")], POOL)
    assert not result.changed and result.metrics["invalid_action"] == 1
    assert model.stages() == ["create"]


def test_improve_and_optimize_description_rewrite_only_their_part():
    model = Scripted(decide=json.dumps({"action": "improve_skill", "content": "Ship with run_task.\n- setting 9"}))
    result = evolver(model).night([session(read="deploy-basics")], POOL)
    new = result.pool["deploy-basics"]
    assert new.body.endswith("- setting 9") and new.description == DEPLOY.description
    assert result.changes == [{"slug": "deploy-basics", "action": "improve_skill", "group": "deploy-basics"}]
    model = Scripted(decide=json.dumps({"action": "optimize_description",
                                        "description": "Ships services to staging. NOT for: billing."}))
    result = evolver(model).night([session(read="deploy-basics")], POOL)
    assert result.pool["deploy-basics"].body == DEPLOY.body
    assert result.pool["deploy-basics"].description == "Ships services to staging. NOT for: billing."


def test_same_name_creates_merge_into_one_skill():
    other = Skill(slug="db-settings", category="database", body="- Known setting database-0.",
                  description="Settings for database. Use for database tasks. NOT for: others.")
    pool = {**POOL, other.slug: other}
    merged = json.dumps({"description": "Merged. NOT for: others.",
                         "content": "- Known setting database-0.\n- Known setting database-1."})
    model = Scripted(create=create(), merge=merged)
    result = evolver(model).night([session(task="db-1", category="database")], pool)
    assert sorted(result.pool) == ["db-settings", "deploy-basics"]  # merged, never duplicated
    assert result.pool["db-settings"].body == "- Known setting database-0.\n- Known setting database-1."
    assert result.metrics["merged"] == 1 and model.stages() == ["create", "merge"]
    # An unusable merge answer keeps both bodies' distinct lines.
    model = Scripted(create=create(content="- Known setting database-0.\n- Known setting database-2."),
                     merge="no idea")
    result = evolver(model).night([session(task="db-1", category="database")], pool)
    assert result.pool["db-settings"].body == "- Known setting database-0.\n\n- Known setting database-2."
    assert result.metrics["merge_fallbacks"] == 1


def test_two_groups_creating_the_same_name_in_one_night_merge():
    model = Scripted(decide=create(content="- from the deploy group"), create=create(content="- from the bucket"),
                     merge="unusable")
    result = evolver(model).night([session(read="deploy-basics"), session(task="db-1", category="database")], POOL)
    assert sorted(result.pool) == ["db-settings", "deploy-basics"]
    assert result.pool["db-settings"].body == "- from the deploy group\n\n- from the bucket"
    assert [c["action"] for c in result.changes] == ["create_skill", "create_skill"]


def test_a_night_never_removes_a_skill_and_refuses_bad_skills():
    secret = create(content="Use api_key = 'abcdef0123456789abcdef' for the db.")
    model = Scripted(decide=json.dumps({"action": "improve_skill", "content": ""}), create=secret)
    result = evolver(model).night([session(read="deploy-basics"), session(task="db-1", category="database")], POOL)
    assert result.pool == POOL and not result.changed
    assert result.metrics["rejected_skills"] == 1 and result.metrics["invalid_action"] == 1
    model = Scripted(create=create(name="Not A Slug"))
    result = evolver(model).night([session(task="db-1", category="database")], POOL)
    assert result.pool == POOL and result.metrics["rejected_skills"] == 1


def test_judge_grades_only_unscored_sessions_and_the_sentinel_is_never_averaged():
    verdict = json.dumps({"completion": 1.0, "quality": 0.5, "efficiency": 0.0, "tool_usage": 0.0})
    model = Scripted(judge=verdict)
    sessions = [session(task="a-1", score=1.0), session(task="a-2", score=0.0), session(task="a-3", score=None)]
    result = evolver(model).night(sessions, POOL)
    assert model.stages().count("judge") == 1 and "a-3" in model.calls[0][1]
    assert result.metrics["mean_reported_score"] == 0.5  # (1 + 0) / 2: the unscored session is not a 0
    assert (result.metrics["scored_sessions"], result.metrics["unscored_sessions"]) == (2, 1)
    judged = result.digests[2]
    assert judged.score is None and judged.judged == pytest.approx(0.55 + 0.30 * 0.5)
    assert "judged; the run was not scored" in judged.render()
    model = Scripted(judge="no verdict")
    result = evolver(model).night([session(score=None)], POOL)
    assert result.metrics["judge_failed"] == 1 and result.digests[0].judged is None
    assert result.metrics["mean_reported_score"] is None  # nothing scored: no mean, never 0


def test_transport_errors_are_retried_then_the_group_is_skipped():
    model = Scripted(create=[UpstreamError("down"), create()])
    result = evolver(model, retries=2).night([session(task="db-1", category="database")], POOL)
    assert result.changed and model.stages() == ["create", "create"]
    model = Scripted(create=[UpstreamError("down"), UpstreamError("down")])
    result = evolver(model, retries=2).night([session(task="db-1", category="database")], POOL)
    assert not result.changed and result.metrics["model_failed"] == 1


def test_summaries_are_asked_per_session_when_enabled():
    model = Scripted(summary="The agent failed because the setting was unknown.")
    opts = SkillClawOptions.from_config({"retries": 1})
    result = Evolver(opts, decide=model).night([session(read="deploy-basics"), session(task="x")], POOL)
    assert model.stages()[:2] == ["summary", "summary"]
    assert all(d.summary for d in result.digests)
    assert "summary: The agent failed" in model.calls[2][1]  # the decision quotes the summaries


def _ctx(files=None, step=2):
    return TrainContext(scenario="s", step=step, serving_release_id="r", serving_version=None, algorithm_state=None,
                        current_files=lambda: encode_tree(pool_files(files or POOL)))


def test_trainer_publishes_the_night_diff_as_one_candidate_or_nothing():
    opts = SkillClawOptions.from_config({"summarize": False, "initial_skills": "reef_skillclaw.examples:seed_skills"})
    trainer = SkillClawTrainer("s", opts, decide=Scripted(create=create()), summary=Scripted(), judge=Scripted())
    assert sorted(validate_pool(trainer.initial_files())) == ["deploy-basics"]
    batch = Batch(batch_id="b1", samples=[session(task="db-1", category="database")], record_ids=["x"], scenario="s")
    update = trainer.train(batch, _ctx())
    assert sorted(validate_pool(update.files)) == ["db-settings", "deploy-basics"]
    assert update.payload == pool_files(validate_pool(update.files))
    assert update.source["changes"][0]["action"] == "create_skill" and update.metrics["changes"] == 1
    quiet = SkillClawTrainer("s", opts, decide=Scripted(), summary=Scripted(), judge=Scripted())
    assert quiet.train(batch, _ctx()) is None  # skip: no release tonight
    assert quiet.status()["last_night"]["actions"]["skip"] == 1


def test_options_are_checked():
    with pytest.raises(ConfigError, match="unknown option"):
        SkillClawOptions.from_config({"batchsize": 3})
    with pytest.raises(ConfigError, match="batch_size"):
        SkillClawOptions.from_config({"batch_size": 0})
    with pytest.raises(ConfigError, match="judge_weights"):
        SkillClawOptions.from_config({"judge_weights": {"completion": 1}})
    with pytest.raises(ConfigError, match="initial_skills"):
        SkillClawTrainer("s", SkillClawOptions.from_config({"initial_skills": {"Bad Slug": {
            "description": "d", "category": "c", "body": "b"}}}), decide=Scripted())
