"""The judge layer: boxed votes, plurality, hint rules, the dispatch table, the callable and prm judges."""

from __future__ import annotations

import logging
import math

import pytest

from reef_core.api import ConfigError
from reef_core.testing import PluginManager
from reef_openclaw.examples import style
from reef_openclaw.judges import (
    TEACHER_BASE,
    TEACHER_HINT,
    CallableJudge,
    dispatch,
    extract_hint,
    parse_boxed,
    plurality,
    select_hints,
)
from reef_openclaw.prm import PRMJudge, PRMOptions, make_prm_judge
from reef_openclaw.processor import build_judge

TURN = {"messages": [{"role": "user", "content": "list three colours"}], "reply": "red, green, blue",
        "agent_record_id": "t1", "tags": {"session": "s"}}
CORRECTION = {"role": "user", "content": "no, as a bulleted list please"}


def test_parse_boxed_reads_the_last_boxed_value_and_refuses_anything_else():
    assert parse_boxed("I think \\boxed{-1} ... actually \\boxed{1}") == 1
    assert parse_boxed("\\boxed{ -1 }") == -1
    assert parse_boxed("\\boxed{0}") == 0
    assert parse_boxed("\\boxed{+1}") == 1
    for bad in ("", "1", "boxed{1}", "\\boxed{2}", "\\boxed{yes}", "\\boxed{1} then \\boxed{maybe}", None, 3):
        assert parse_boxed(bad) is None, bad


def test_plurality_ties_and_invalid_votes_give_zero():
    assert plurality([1, 1, -1]) == 1
    assert plurality([-1, None, -1]) == -1
    assert plurality([1, -1, None]) == 0  # tied plurality
    assert plurality([1, -1, 0]) == 0
    assert plurality([None, None, None]) == 0  # no valid vote
    assert plurality([]) == 0
    assert plurality([0, 0, 1]) == 0
    assert plurality([None, None, -1]) == -1  # one valid vote is a plurality


def test_hint_extraction_and_candidate_rules():
    assert extract_hint("\\boxed{1} [HINT_START] Use bullets. [HINT_END]") == "Use bullets."
    assert extract_hint("[HINT_START]first[HINT_END] [HINT_START]second[HINT_END]") == "second"
    assert extract_hint("[HINT_START]never closed") is None
    assert extract_hint("no markers") is None
    hints = ["Answer with a bulleted list.", "too short", "  Answer with a bulleted list.  ", None,
             "Put each colour on its own line, with a dash.", "exactly10!", "Use bullets!", 7]
    # > 10 characters (10 is out), deduplicated after stripping, shortest first, at most 3
    assert select_hints(hints) == ["Use bullets!", "Answer with a bulleted list.",
                                   "Put each colour on its own line, with a dash."]
    assert select_hints(hints, limit=1) == ["Use bullets!"]
    assert select_hints([]) == []


@pytest.mark.parametrize("verdict, outcome", [
    ({"score": 1.0, "hints": ["Use a bulleted list."]}, (1.0, TEACHER_HINT)),
    ({"score": -1.0, "hints": ["Use a bulleted list."]}, (-1.0, TEACHER_HINT)),
    ({"score": 0.0, "hints": ["Use a bulleted list."]}, (0.0, TEACHER_HINT)),
    ({"score": 1.0, "hints": []}, (1.0, TEACHER_BASE)),
    ({"score": -1.0, "hints": []}, (-1.0, TEACHER_BASE)),
    ({"score": 0.0, "hints": []}, None),
])
def test_dispatch_table(verdict, outcome):
    assert dispatch(verdict) == outcome


def _rule(*, turn, next_state):
    if "bulleted" in next_state["content"]:
        return {"score": -1, "hint": "Answer with a bulleted list."}
    return {"score": 1, "hint": None}


def test_callable_judge_calls_with_plain_dicts_and_counts_failed_votes():
    judge = CallableJudge(_rule, name="rule")
    assert judge(turn=TURN, next_state=CORRECTION) == {"score": -1.0, "hints": ["Answer with a bulleted list."]}
    assert judge(turn=TURN, next_state={"role": "user", "content": "thanks"}) == {"score": 1.0, "hints": []}

    def boom(**_):
        raise RuntimeError("judge broke")

    for bad in (boom, lambda **_: {"score": math.nan}, lambda **_: {"score": True}, lambda **_: 1.0,
                lambda **_: {"hint": "Answer with a bulleted list."}):
        failing = CallableJudge(bad)
        assert failing(turn=TURN, next_state=CORRECTION) == {"score": 0.0, "hints": [], "failed": True}
        assert failing.status()["failed_votes"] == 1
    assert judge.status()["calls"] == 2 and judge.status()["failed_votes"] == 0


def test_callable_judge_is_built_from_a_dotted_path_through_the_registry():
    pm = PluginManager()
    judge = build_judge("reef_openclaw.examples.style:judge", None, create=pm.create)
    assert isinstance(judge, CallableJudge) and judge.name == "reef_openclaw.examples.style:judge"
    built = pm.create("judge", "callable", options={"function": "reef_openclaw.examples.style:judge"})
    assert built.function is style.judge
    with pytest.raises(ConfigError, match="judges.callable.function"):
        pm.create("judge", "callable", options={})
    with pytest.raises(ConfigError, match="unknown option"):
        pm.create("judge", "callable", options={"function": "reef_openclaw.examples.style:judge", "m": 3})
    with pytest.raises(ConfigError, match="no judge named"):
        build_judge("nope", None)


class ScriptedChat:
    """A chat model answering evaluative and directive calls from two lists, in call order."""

    def __init__(self, evaluative, directive):
        self.answers = {"evaluative": list(evaluative), "directive": list(directive)}
        self.seen = []

    def __call__(self, messages):
        kind = "directive" if "[HINT_START]" in messages[0]["content"] else "evaluative"
        self.seen.append((kind, messages))
        answer = self.answers[kind].pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_prm_judge_votes_parses_and_collects_hints():
    chat = ScriptedChat(
        ["The user asks for a change. \\boxed{-1}", "\\boxed{-1}", "\\boxed{1}"],
        ["\\boxed{1} [HINT_START]Format the answer as a bulleted list of colours.[HINT_END]",
         "\\boxed{1} [HINT_START]Use bullets.[HINT_END]",
         "\\boxed{-1} [HINT_START]this hint belongs to a -1 vote[HINT_END]"])
    judge = PRMJudge(chat, PRMOptions(m=3, concurrency=1))
    verdict = judge(turn=TURN, next_state=CORRECTION)
    assert verdict == {"score": -1.0, "hints": ["Use bullets.", "Format the answer as a bulleted list of colours."]}
    assert [kind for kind, _ in chat.seen] == ["evaluative"] * 3 + ["directive"] * 3
    prompt = chat.seen[0][1][1]["content"]
    assert "list three colours" in prompt and "red, green, blue" in prompt and CORRECTION["content"] in prompt
    assert judge.status()["calls"] == 6 and judge.status()["failed_votes"] == 0


def test_prm_judge_failed_and_unparsable_votes_count_as_zero():
    chat = ScriptedChat([RuntimeError("timeout"), "no box at all", "\\boxed{1}"],
                        [RuntimeError("down"), "\\boxed{1} no markers", "\\boxed{1} [HINT_START]short[HINT_END]"])
    judge = PRMJudge(chat, PRMOptions(m=3, concurrency=1))
    # one valid vote (1) against two invalid ones: a plurality of one; no hint survives the rules
    assert judge(turn=TURN, next_state=CORRECTION) == {"score": 1.0, "hints": []}
    assert judge.status()["failed_votes"] == 3  # two evaluative, one directive without a boxed value
    tie = PRMJudge(ScriptedChat(["\\boxed{1}", "\\boxed{-1}", RuntimeError("x")], ["\\boxed{-1}"] * 3),
                   PRMOptions(m=3, concurrency=1))
    assert tie(turn=TURN, next_state=CORRECTION) == {"score": 0.0, "hints": []}


def test_prm_options_are_validated_and_fill_the_sampling_settings():
    with pytest.raises(ConfigError, match="judges.prm.m"):
        PRMOptions.parse({"m": 0})
    with pytest.raises(ConfigError, match="unknown option"):
        PRMOptions.parse({"prm_m": 3})
    with pytest.raises(ConfigError, match="timeout_s"):
        PRMOptions.parse({"timeout_s": 0})
    opts = PRMOptions.parse({"model": {"url": "http://127.0.0.1:1", "request": {"top_p": 0.95}}, "temperature": 0.6})
    spec = opts.chat_spec()
    assert spec["request"] == {"temperature": 0.6, "max_tokens": 8192, "top_p": 0.95} and spec["timeout_s"] == 120.0
    assert PRMOptions().chat_spec() == {"kind": "served", "request": {"temperature": 0.6, "max_tokens": 8192}}
    with pytest.raises(ConfigError, match="served engine"):
        make_prm_judge(options={})  # the served model, but no engine to serve it


def test_a_failing_judge_warns_once_per_scenario_and_reason(caplog):
    # #37: a raising judge counted failed_votes, every turn was retired neutral, and nothing was logged.
    def raising(*, turn, next_state):
        raise RuntimeError("the rule broke")

    caplog.set_level(logging.WARNING, logger="reef_openclaw.judges")
    judge = CallableJudge(raising, name="pkg.rules:raising")
    judge.scenario = "chat-a"
    turn = {"messages": [], "reply": "x", "agent_record_id": "r1", "tags": {}}
    for _ in range(3):
        assert judge(turn=turn, next_state={"role": "user", "content": "y"}) == {"score": 0.0, "hints": [],
                                                                                  "failed": True}
    judge.function = lambda **_: {"score": "high"}
    judge(turn=turn, next_state={"role": "user", "content": "y"})
    judge(turn=turn, next_state={"role": "user", "content": "y"})
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2, warned
    assert "chat-a" in warned[0] and "pkg.rules:raising" in warned[0] and "RuntimeError" in warned[0]
    assert "no finite score" in warned[1]
    assert judge.status()["failed_votes"] == 5
