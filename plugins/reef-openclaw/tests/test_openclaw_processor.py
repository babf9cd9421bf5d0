"""The ``openclaw`` processor: sessions, TTL and the last-turn rule, dispatch into samples, judge cost in status, and
the ``prm`` judge over HTTP against a stand-in judge model (boxed scores, hints, malformed answers, errors)."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse

from reef_core.api import Record, serve_asgi
from reef_core.testing import PluginManager
from reef_openclaw.examples import style
from reef_openclaw.judges import CallableJudge, next_state_view, turn_view
from reef_openclaw.processor import make_openclaw_processor

SCENARIO = "claw"


class Stream:
    def __init__(self):
        self._n = itertools.count(1)

    def turn(self, messages, reply, *, session=None, created_at=None) -> Record:
        n = next(self._n)
        payload = {"route": "chat", "dialect": "openai", "request": {"model": "m", "messages": messages},
                   "response": {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]}}
        return Record(record_id=f"t{n}", scenario=SCENARIO, kind="inference", payload=payload,
                      tags={"session": session} if session else {}, version="inc:1", sequence=n,
                      **({"created_at": created_at} if created_at is not None else {}))


def u(text):
    return {"role": "user", "content": text}


def a(text):
    return {"role": "assistant", "content": text}


def drain(p):
    out = []
    while (batch := p.pending_batch()) is not None:
        out += batch.samples
        p.acknowledge(batch.batch_id)
    return out


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_views_given_to_the_judge_are_plain_dicts():
    s = Stream()
    turn = s.turn([u("Is the sum the answer?")], "No, the sum.", session="A")
    after = s.turn([u("Is the sum the answer?"), a("No, the sum."), u("No, not like that. Q2")],
                   "Yes.", session="A")
    assert turn_view(turn) == {"messages": [u("Is the sum the answer?")], "reply": "No, the sum.",
                               "agent_record_id": "t1", "tags": {"session": "A"}}
    assert next_state_view(turn, after) == {"role": "user", "content": "No, not like that. Q2"}
    tools = s.turn([u("Is the sum the answer?"), a("No, the sum."),
                    {"role": "tool", "tool_call_id": "c1", "content": "ok 1"},
                    {"role": "tool", "tool_call_id": "c2", "content": "ok 2"}, u("and?")], "x")
    assert next_state_view(turn, tools) == {"role": "tool", "content": "ok 1\nok 2"}
    assert next_state_view(turn, s.turn([u("Is the sum the answer?"), a("No, the sum."), a("again")], "x")) is None


def test_dispatch_into_samples_and_the_last_turn_never_trains():
    s, clock = Stream(), Clock()
    judge = CallableJudge(style.judge)
    p = make_openclaw_processor(scenario=SCENARIO, options={"batch_size": 2, "session_ttl_s": 60}, judge=judge)
    p._clock = clock  # the core processor's clock: expiry without sleeping
    q1, q2, q3 = u("Is the sum the answer?"), "Is the city the capital?", "Is the value the result?"
    t1 = s.turn([q1], "No, the sum.", session="A", created_at=clock.now)
    t2 = s.turn([q1, a("No, the sum."), u(f"{style.CORRECTION} {q2}")], "Yes, the city.", session="A",
                created_at=clock.now)
    t3 = s.turn([q1, a("No, the sum."), u(f"{style.CORRECTION} {q2}"), a("Yes, the city."),
                 u(f"{style.THANKS} {q3}")], "Yes.", session="A", created_at=clock.now)
    for r in (t1, t2, t3):
        p.ingest(r)
    assert judge.meter.calls == 0  # ingest never judges
    samples = drain(p)
    assert [(smp.source_ids, smp.reward) for smp in samples] == [(["t1"], -1.0), (["t2"], 1.0)]
    assert samples[0].metadata["openclaw"] == {"score": -1.0, "hints": [style.HINT], "teacher": "hint",
                                               "source": "judge"}
    assert samples[1].metadata["openclaw"] == {"score": 1.0, "hints": [], "teacher": "base", "source": "judge"}
    status = p.status()
    assert status["open_turns"] == 1  # t3: nothing followed it yet
    assert status["openclaw"]["dispatch"] == {"hint_and_score": 1, "score_only": 1}
    assert status["openclaw"]["judge"]["calls"] == 2 and status["openclaw"]["judge"]["seconds"] >= 0
    clock.now += 61
    status = p.status()
    assert status["open_turns"] == 0 and status["dropped"].get("session_expired") == 1
    assert p.pending_batch() is None and judge.meter.calls == 2  # the last turn was never judged


def test_ttl_expires_a_turn_before_its_late_next_state_and_neutral_turns_retire():
    s, clock = Stream(), Clock()
    neutral = CallableJudge(lambda **_: {"score": 0.0, "hint": None})
    p = make_openclaw_processor(scenario=SCENARIO, options={"batch_size": 1, "session_ttl_s": 30}, judge=neutral)
    p._clock = clock
    p.ingest(s.turn([u("q")], "r", session="B", created_at=clock.now))
    clock.now += 31
    p.ingest(s.turn([u("q"), a("r"), u("thanks")], "r2", session="B", created_at=clock.now))  # too late
    assert p.pending_batch() is None and neutral.meter.calls == 0
    assert p.status()["dropped"]["session_expired"] == 1
    p.ingest(s.turn([u("q"), a("r"), u("thanks"), a("r2"), u("ok")], "r3", session="B", created_at=clock.now))
    assert p.pending_batch() is None and neutral.meter.calls == 1
    status = p.status()
    assert status["openclaw"]["dispatch"] == {"retired_neutral": 1} and status["dropped"]["retired_neutral"] == 1


# -- the prm judge over HTTP ------------------------------------------------------------------------------------------


class JudgeModel:
    """A stand-in judge model: answers by the case named in the next state, one scripted answer per call."""

    CASES = {
        # evaluative answers, directive answers (each list in call order; calls of one pair may interleave)
        "CASE-bad": (["Change requested. \\boxed{-1}", "\\boxed{-1}", "\\boxed{1}"],
                     ["\\boxed{1} [HINT_START]Start the reply with the word Yes.[HINT_END]",
                      "\\boxed{1} [HINT_START]Start the reply with the word Yes.[HINT_END]",
                      "\\boxed{1} [HINT_START]Say Yes first.[HINT_END]"]),
        "CASE-good": (["\\boxed{1}", "\\boxed{1}", "the user is happy"], ["\\boxed{-1}"] * 3),
        "CASE-malformed": (["\\boxed{yes}", "boxed 1", "ERROR"], ["[HINT_START]no box[HINT_END]", "\\boxed{1}",
                                                               "\\boxed{1} [HINT_START]tiny[HINT_END]"]),
        "CASE-hint-only": (["\\boxed{1}", "\\boxed{-1}", "\\boxed{0}"],
                           ["\\boxed{1} [HINT_START]Answer in one short sentence.[HINT_END]", "ERROR", "\\boxed{-1}"]),
    }

    def __init__(self):
        self.lock = threading.Lock()
        self.queues = {case: ([*ev], [*di]) for case, (ev, di) in self.CASES.items()}
        self.bodies = []

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            messages = body["messages"]
            with self.lock:
                self.bodies.append(body)
                case = next(c for c in self.CASES if c in messages[-1]["content"])
                directive = "[HINT_START]" in messages[0]["content"]
                answer = self.queues[case][1 if directive else 0].pop(0)
            if answer == "ERROR":
                return JSONResponse({"error": {"message": "overloaded", "type": "server_error"}}, status_code=500)
            return {"id": "chatcmpl-judge", "object": "chat.completion", "created": int(time.time()),
                    "model": body.get("model", "judge"),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

        return app


@pytest.fixture
def judge_model():
    model = JudgeModel()
    with serve_asgi(model.app()) as url:
        yield model, url


def test_prm_judge_over_http_scores_hints_and_survives_malformed_answers(judge_model):
    model, url = judge_model
    pm = PluginManager()
    p = pm.create("processor", "openclaw", scenario=SCENARIO, create=pm.create,
                  options={"batch_size": 1, "judge": "prm",
                           "judges": {"prm": {"model": {"url": url, "model": "judge-1"}, "m": 3, "concurrency": 3,
                                              "timeout_s": 10}}})
    s = Stream()
    for i, case in enumerate(JudgeModel.CASES):
        p.ingest(s.turn([u(f"question {i}")], f"reply {i}", session=case))
        p.ingest(s.turn([u(f"question {i}"), a(f"reply {i}"), u(f"{case}: next message")], "later", session=case))
    samples = drain(p)
    by_session = {smp.metadata["reef"]["session"]: smp for smp in samples}
    assert set(by_session) == {"CASE-bad", "CASE-good", "CASE-hint-only"}  # malformed: score 0, no hint: retired
    bad = by_session["CASE-bad"]
    assert bad.reward == -1.0 and bad.metadata["openclaw"]["hints"] == [
        "Say Yes first.", "Start the reply with the word Yes."]  # deduplicated, shortest first
    good = by_session["CASE-good"]
    assert good.reward == 1.0 and good.metadata["openclaw"]["teacher"] == "base"
    hint_only = by_session["CASE-hint-only"]
    assert hint_only.reward == 0.0 and hint_only.metadata["openclaw"] == {
        "score": 0.0, "hints": ["Answer in one short sentence."], "teacher": "hint", "source": "judge"}
    status = p.status()["openclaw"]
    assert status["dispatch"] == {"hint_and_score": 1, "hint_only": 1, "retired_neutral": 1, "score_only": 1}
    assert status["judge"]["calls"] == 24 and status["judge"]["seconds"] > 0
    # votes without a boxed value (unparsable, or a 500): good 1, malformed 3 + 1, hint-only 1
    assert status["judge"]["failed_votes"] == 1 + 4 + 1
    assert all(b["model"] == "judge-1" and b["temperature"] == 0.6 and b["max_tokens"] == 8192 for b in model.bodies)
    assert any("reply 0" in b["messages"][1]["content"] and "CASE-bad: next message" in b["messages"][1]["content"]
               for b in model.bodies)


def test_an_explicit_report_wins_over_the_judge():
    s = Stream()
    judge = CallableJudge(style.judge)
    p = make_openclaw_processor(scenario=SCENARIO, options={"batch_size": 1}, judge=judge)
    p.ingest(s.turn([u("Is the sum the answer?")], "No, the sum.", session="A"))
    p.ingest(Record(record_id="rep1", scenario=SCENARIO, kind="report", payload={"score": 1.0},
                    references=["t1"], sequence=99))
    p.ingest(s.turn([u("Is the sum the answer?"), a("No, the sum."), u(f"{style.CORRECTION} q")], "x", session="A"))
    batch = p.pending_batch()
    smp = batch.samples[0]
    assert (smp.source_ids, smp.reward) == (["t1", "rep1"], 1.0) and "openclaw" not in smp.metadata
    assert judge.meter.calls == 0  # the judge would have said -1
