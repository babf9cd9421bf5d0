"""NextStateProcessor: correlation by session tag and by transcript, lazy judging, expiry, recovery."""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading

import pytest

from reef_core.observe.model import Record
from reef_core.observe.processors import NextStateProcessor

SCENARIO = "claw"
TOOLS = [{"type": "function", "function": {"name": "sh", "parameters": {"type": "object"}}}]


class Stream:
    def __init__(self):
        self._n = itertools.count(1)

    def turn(self, messages, reply, *, session=None, version="inc:1", tools=None, complete=True, created_at=None,
             rid=None) -> Record:
        n = next(self._n)
        request = {"model": "m", "messages": messages}
        if tools:
            request["tools"] = tools
        payload = {"route": "chat", "dialect": "openai", "client_dialect": "openai", "stream": False,
                   "request": request, "engine": "test", "timings": {},
                   "response": {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]}}
        return Record(record_id=rid or f"t{n}", scenario=SCENARIO, kind="inference", payload=payload,
                      tags={"session": session} if session else {}, version=version, complete=complete,
                      sequence=n, **({"created_at": created_at} if created_at is not None else {}))


def u(text):
    return {"role": "user", "content": text}


def a(text):
    return {"role": "assistant", "content": text}


class Judge:
    """Scores by the next state's text; records every call and the thread it ran on."""

    def __init__(self, answers=None):
        self.answers = answers or {}
        self.calls: list[tuple[str, str]] = []
        self.threads: set[int] = set()

    def __call__(self, record, next_record):
        self.calls.append((record.record_id, next_record.record_id))
        self.threads.add(threading.get_ident())
        answer = self.answers.get(record.record_id, 1.0)
        return answer(record) if callable(answer) else answer


def drain(p):
    out = []
    while (batch := p.pending_batch()) is not None:
        out += batch.samples
        p.acknowledge(batch.batch_id)
    return out


def test_pairs_by_session_tag_and_judges_lazily_on_the_learner_thread():
    s = Stream()
    judge = Judge({"t1": 1.0, "t2": -1.0})
    p = NextStateProcessor(SCENARIO, judge=judge, batch_size=2)
    ingested = [
        s.turn([u("hi")], "hello", session="A"),
        s.turn([u("other")], "x", session="B"),
        s.turn([u("hi"), a("hello"), u("thanks")], "bye", session="A"),
        s.turn([u("other"), a("x"), u("no, redo that")], "y", session="B"),
    ]
    ingester = threading.Thread(target=lambda: [p.ingest(r) for r in ingested])
    ingester.start()
    ingester.join()
    assert judge.calls == []  # ingestion never judges
    assert p.status()["pairs_waiting_for_judge"] == 2
    batch = p.pending_batch()
    assert judge.threads == {threading.get_ident()}
    assert [(smp.source_ids, smp.reward) for smp in batch.samples] == [(["t1"], 1.0), (["t2"], -1.0)]
    first = batch.samples[0]
    assert first.messages == [u("hi"), a("hello")] and first.completion == "hello"
    assert first.metadata["reef"]["next_record_id"] == "t3"
    assert first.metadata["reef"]["next_state"] == [u("thanks")]
    assert first.metadata["reef"]["correlation"] == "tag" and first.metadata["reef"]["session"] == "A"
    assert json.dumps(batch.to_dict()) and json.dumps(p.status())
    assert p.acknowledge(batch.batch_id) == ["t1", "t2"]
    # t3 and t4 are the last turns of their sessions: nothing followed them yet.
    assert p.status()["open_turns"] == 2 and not p.ready()


def test_pairs_by_transcript_when_no_session_tag_is_sent():
    s = Stream()
    judge = Judge()
    p = NextStateProcessor(SCENARIO, judge=judge)
    t1 = s.turn([u("q1")], "a1")
    unrelated = s.turn([u("something else")], "z")
    t2 = s.turn([u("q1"), a("a1"), u("q2")], "a2")
    t3 = s.turn([u("q1"), a("a1"), u("q2"), a("a2"), {"role": "tool", "tool_call_id": "c", "content": "out"},
                 u("q3")], "a3")
    for record in (t1, unrelated, t2, t3):
        p.ingest(record)
    samples = drain(p)
    assert [smp.source_ids for smp in samples] == [["t1"], ["t3"]]
    assert judge.calls == [("t1", "t3"), ("t3", "t4")]
    assert samples[1].metadata["reef"]["next_state"] == [{"role": "tool", "tool_call_id": "c", "content": "out"},
                                                         u("q3")]
    assert samples[0].metadata["reef"]["correlation"] == "transcript"
    assert p.status()["pairs_by_correlation"] == {"tag": 0, "transcript": 2}


def test_judge_wait_never_and_invalid_answers():
    s = Stream()
    verdicts = {"t1": "wait", "t3": "never", "t5": "maybe", "t7": {"score": 0.5, "feedback": "ok",
                                                                   "metadata": {"votes": [1, 0, 1]}}}
    judge = Judge(verdicts)
    p = NextStateProcessor(SCENARIO, judge=judge)
    for i in range(4):
        p.ingest(s.turn([u(f"q{i}")], f"a{i}", session=f"S{i}"))
        p.ingest(s.turn([u(f"q{i}"), a(f"a{i}"), u("next")], "z", session=f"S{i}"))
    batch = p.pending_batch()
    assert [smp.source_ids for smp in batch.samples] == [["t7"]]
    assert batch.samples[0].feedback == "ok" and batch.samples[0].metadata["votes"] == [1, 0, 1]
    p.acknowledge(batch.batch_id)
    assert p.status()["dropped"] == {"judge_invalid": 1, "judge_never": 1}
    assert p.status()["pairs_waiting_for_judge"] == 1  # t1 waits
    assert p.recheck_after() == 1.0  # asked again soon, without a new record
    calls = len(judge.calls)
    assert not p.ready()
    assert len(judge.calls) == calls + 1  # asked once per call, not in a loop
    verdicts["t1"] = 0.25
    assert [smp.reward for smp in drain(p)] == [0.25]
    assert p.pending_batch() is None


def test_a_judge_that_says_why_a_turn_never_trains_is_counted_under_its_reason():
    s = Stream()
    judge = Judge({"t1": {"never": "judge_failed"}, "t3": {"never": ""}, "t5": {"never": "judge_failed"}})
    p = NextStateProcessor(SCENARIO, judge=judge)
    for i in range(3):
        p.ingest(s.turn([u(f"q{i}")], f"a{i}", session=f"S{i}"))
        p.ingest(s.turn([u(f"q{i}"), a(f"a{i}"), u("next")], "z", session=f"S{i}"))
    assert p.pending_batch() is None
    assert p.status()["dropped"] == p.dropped() == {"judge_failed": 2, "judge_never": 1}  # no reason: judge_never


def test_judge_errors_are_retried_then_dropped():
    s = Stream()
    attempts = []

    def flaky(record, next_record):
        attempts.append(record.record_id)
        raise RuntimeError("reward model down")

    p = NextStateProcessor(SCENARIO, judge=flaky, max_judge_attempts=2)
    p.ingest(s.turn([u("q")], "a", session="S"))
    p.ingest(s.turn([u("q"), a("a"), u("more")], "b", session="S"))
    assert not p.ready() and p.status()["pairs_waiting_for_judge"] == 1
    assert not p.ready()
    assert attempts == ["t1", "t1"] and p.status()["dropped"] == {"judge_error": 1}


def test_the_judge_runs_without_the_lock_so_ingestion_continues():
    s = Stream()
    first = s.turn([u("q")], "a", session="S")
    second = s.turn([u("q"), a("a"), u("more")], "b", session="S")
    later = s.turn([u("x")], "y", session="other")
    seen = []

    def slow_judge(record, next_record):
        worker = threading.Thread(target=p.ingest, args=(later,))
        worker.start()
        worker.join(timeout=10)
        seen.append(not worker.is_alive())
        return 1.0

    p = NextStateProcessor(SCENARIO, judge=slow_judge)
    p.ingest(first)
    p.ingest(second)
    assert p.ready()
    assert seen == [True] and p.status()["records_ingested"] == 3


def test_retries_side_calls_and_incomplete_turns_are_retired():
    s = Stream()
    judge = Judge()
    p = NextStateProcessor(SCENARIO, judge=judge)
    main = s.turn([u("fix the bug")], "looking", session="S", tools=TOOLS)
    retry = s.turn([u("fix the bug")], "looking again", session="S", tools=TOOLS)
    title = s.turn([u("Write a title for: fix the bug")], "Bug fix", session="S")  # no tools: side call
    broken = s.turn([u("fix the bug"), a("looking again"), u("and?")], "", session="S", complete=False)
    follow = s.turn([u("fix the bug"), a("looking again"), u("and?")], "done", session="S", tools=TOOLS)
    for record in (main, retry, title, broken, follow):
        p.ingest(record)
    samples = drain(p)
    assert judge.calls == [(retry.record_id, follow.record_id)]
    assert samples[0].completion == "looking again"
    assert p.status()["dropped"] == {"incomplete": 1, "retried": 1, "side_call": 1}


def test_untagged_retry_replaces_the_open_turn():
    s = Stream()
    judge = Judge()
    p = NextStateProcessor(SCENARIO, judge=judge)
    for record in (s.turn([u("q")], "a"), s.turn([u("q")], "b"), s.turn([u("q"), a("b"), u("ok")], "c")):
        p.ingest(record)
    assert [smp.completion for smp in drain(p)] == ["b"]
    assert p.status()["dropped"] == {"retried": 1}


def test_unanswered_turns_expire_after_the_session_ttl():
    s = Stream()
    now = {"t": 1000.0}
    p = NextStateProcessor(SCENARIO, judge=Judge(), session_ttl_s=60, clock=lambda: now["t"])
    p.ingest(s.turn([u("q")], "a", session="S", created_at=1000.0))
    now["t"] = 1059.0
    assert p.status()["open_turns"] == 1
    assert p.recheck_after() == pytest.approx(1.0)  # when the open turn expires
    now["t"] = 1061.0
    assert p.status()["open_turns"] == 0 and p.status()["dropped"] == {"session_expired": 1}
    # a late follow-up starts fresh: the expired turn never trains
    p.ingest(s.turn([u("q"), a("a"), u("late")], "b", session="S", created_at=1061.0))
    assert not p.ready()


def test_a_next_state_arriving_after_the_ttl_never_pairs_even_unobserved():
    # nothing looked at the processor between the two records (no status, no ready): the turn still expires
    s = Stream()
    now = {"t": 1000.0}
    judge = Judge()
    p = NextStateProcessor(SCENARIO, judge=judge, session_ttl_s=60, clock=lambda: now["t"])
    p.ingest(s.turn([u("q")], "a", session="S", created_at=1000.0))
    now["t"] = 1061.0
    p.ingest(s.turn([u("q"), a("a"), u("late")], "b", session="S", created_at=1061.0))
    assert not p.ready() and judge.calls == []
    assert p.status()["dropped"] == {"session_expired": 1}


def test_without_a_judge_pairs_are_correlated_but_nothing_trains():
    s = Stream()
    p = NextStateProcessor(SCENARIO, judge=None)
    p.ingest(s.turn([u("q")], "a", session="S"))
    p.ingest(s.turn([u("q"), a("a"), u("more")], "b", session="S"))
    assert not p.ready() and p.status()["pairs_waiting_for_judge"] == 1 and p.status()["judge"] is False


@pytest.mark.parametrize("window,expected", [(0, []), (1, [["t1"]])])
def test_stale_turns_are_dropped_before_the_judge_is_paid(window, expected):
    s = Stream()
    judge = Judge()
    p = NextStateProcessor(SCENARIO, judge=judge, max_staleness=window, serving_version=lambda: "inc:2")
    p.ingest(s.turn([u("q")], "a", session="S", version="inc:1"))
    p.ingest(s.turn([u("q"), a("a"), u("more")], "b", session="S", version="inc:2"))
    assert [smp.source_ids for smp in drain(p)] == expected
    assert len(judge.calls) == len(expected)
    assert p.status()["dropped"] == ({} if expected else {"stale": 1})


def test_restart_never_rejudges_consumed_turns_but_still_correlates_through_them():
    s = Stream()
    records = [s.turn([u("q1")], "a1", session="S"),
               s.turn([u("q1"), a("a1"), u("q2")], "a2", session="S"),
               s.turn([u("q1"), a("a1"), u("q2"), a("a2"), u("q3")], "a3", session="S")]
    first = NextStateProcessor(SCENARIO, judge=Judge())
    for record in records[:2]:
        first.ingest(record)
    consumed = set()
    for smp in drain(first):
        consumed.update(smp.source_ids)
    assert consumed == {"t1"}

    judge = Judge()
    restarted = NextStateProcessor(SCENARIO, judge=judge)
    restarted.restore(consumed)
    for record in records:
        restarted.ingest(record)
    assert [smp.source_ids for smp in drain(restarted)] == [["t2"]]
    assert judge.calls == [("t2", "t3")]
    assert restarted.status()["replayed_consumed"] == 1


# -- memory: waiting turns hold no bodies; the store is read when a pair is judged ------------------------------------


class Store:
    """A record store stand-in: ``load_records`` answers from ``records`` and logs every read."""

    def __init__(self):
        self.records: dict[str, Record] = {}
        self.reads: list[list[str]] = []

    def load_records(self, ids):
        self.reads.append(list(ids))
        return [self.records.get(i) for i in ids]


def held_fields(obj):
    """Every field value of a held dataclass, nested turns included."""
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out += held_fields(value) if dataclasses.is_dataclass(value) else [value]
    return out


def test_waiting_turns_hold_no_bodies_only_ids_and_digests():
    s, store = Stream(), Store()
    p = NextStateProcessor(SCENARIO, judge=Judge(), load_records=store.load_records, batch_size=1000)
    big = "x" * 10_000
    for i in range(100):
        first = s.turn([u(f"q{i} {big}")], f"a{i} {big}", session=f"S{i}", tools=TOOLS)
        follow = s.turn([u(f"q{i} {big}"), a(f"a{i} {big}"), u(f"more {big}")], "b", session=f"S{i}")
        plain = s.turn([u(f"untagged {i} {big}")], f"r{i} {big}")
        for record in (first, follow, plain):
            store.records[record.record_id] = record
            p.ingest(record)
    status = p.status()
    assert status["open_turns"] == 200 and status["pairs_waiting_for_judge"] == 100
    held = [*p._open.values(), *p._sessions.values(), *p._by_transcript.values(), *p._by_prompt.values(), *p._jobs]
    values = [v for obj in held for v in held_fields(obj)]
    assert values and all(v is None or isinstance(v, (str, int, float, bool)) for v in values)
    assert max(len(v) for v in values if isinstance(v, str)) <= 64  # ids and digests, never a prompt
    assert store.reads == []  # correlation never reads the store


@pytest.mark.parametrize("with_store", [True, False])
def test_judging_reads_exactly_the_pair_back_and_builds_the_same_sample(with_store):
    s, store = Stream(), Store()
    judge = Judge()
    p = NextStateProcessor(SCENARIO, judge=judge, load_records=store.load_records if with_store else None)
    records = [s.turn([u("q1")], "a1", session="A"),
               s.turn([u("other")], "x", session="B"),
               # rewrites the reply it resends: the next state starts where the transcripts part
               s.turn([u("q1"), a("a1, edited"), u("q2")], "a2", session="A")]
    for record in records:
        store.records[record.record_id] = record
        p.ingest(record)
    batch = p.pending_batch()
    assert judge.calls == [("t1", "t3")]
    assert store.reads == ([["t1", "t3"]] if with_store else [])
    sample = batch.samples[0]
    assert sample.source_ids == ["t1"] and sample.messages == [u("q1"), a("a1")]
    assert sample.metadata["reef"]["next_state"] == [a("a1, edited"), u("q2")]
    assert sample.metadata["reef"]["next_record_id"] == "t3"


@pytest.mark.parametrize("gone", ["t1", "t2"])
def test_a_pair_whose_record_the_store_lost_is_dropped_unjudged(gone):
    s, store = Stream(), Store()
    judge = Judge()
    p = NextStateProcessor(SCENARIO, judge=judge, load_records=store.load_records)
    for record in (s.turn([u("q")], "a", session="S"), s.turn([u("q"), a("a"), u("more")], "b", session="S")):
        store.records[record.record_id] = record
        p.ingest(record)
    del store.records[gone]
    assert not p.ready()
    assert judge.calls == [] and p.status()["dropped"] == {"record_gone": 1}
    assert p.status()["pairs_waiting_for_judge"] == 0


def test_a_failing_store_read_keeps_the_pair_for_a_later_call():
    s, store = Stream(), Store()
    judge = Judge()
    failing = {"on": True}

    def load_records(ids):
        if failing["on"]:
            raise OSError("database restarting")
        return store.load_records(ids)

    p = NextStateProcessor(SCENARIO, judge=judge, load_records=load_records)
    for record in (s.turn([u("q")], "a", session="S"), s.turn([u("q"), a("a"), u("more")], "b", session="S")):
        store.records[record.record_id] = record
        p.ingest(record)
    assert not p.ready() and judge.calls == []
    assert p.status()["pairs_waiting_for_judge"] == 1 and p.status()["dropped"] == {}
    assert p.recheck_after() == 1.0
    failing["on"] = False
    assert [smp.source_ids for smp in drain(p)] == [["t1"]]


def test_the_factory_passes_load_records_on():
    from reef_core.plugins import PluginManager

    s, store = Stream(), Store()
    p = PluginManager(load_entry_points=False).get("processor", "next_state").factory(
        scenario=SCENARIO, options={}, serving_version=lambda: None, judge=lambda record, next_record: 0.5,
        load_records=store.load_records)
    for record in (s.turn([u("q")], "a", session="S"), s.turn([u("q"), a("a"), u("more")], "b", session="S")):
        store.records[record.record_id] = record
        p.ingest(record)
    assert all(turn.body is None for turn in p._open.values())
    assert [smp.reward for smp in drain(p)] == [0.5] and store.reads == [["t1", "t2"]]


def test_replay_from_the_real_store_judges_with_the_store_copies(tmp_path):
    from reef_core.observe.records import RecordStore

    store = RecordStore.open(None, tmp_path)
    try:
        s = Stream()
        for record in (s.turn([u("q1")], "a1", session="S"), s.turn([u("q1"), a("a1"), u("q2")], "a2", session="S")):
            store.append_sync(dataclasses.replace(record, sequence=None))
        judge = Judge()
        p = NextStateProcessor(SCENARIO, judge=judge, load_records=lambda ids: store.get_many(SCENARIO, ids))
        for record in store.replay(SCENARIO):
            p.ingest(record)
        [sample] = drain(p)
        assert judge.calls == [("t1", "t2")]
        assert sample.messages == [u("q1"), a("a1")] and sample.metadata["reef"]["next_state"] == [u("q2")]
    finally:
        store.close()


# -- explicit reports win over the judge ------------------------------------------------------------------------------


_REPORT_SEQ = itertools.count(1000)


def report(rid, refs, score, **payload):
    return Record(record_id=rid, scenario=SCENARIO, kind="report", payload={"score": score, **payload},
                  references=list(refs), sequence=next(_REPORT_SEQ))


def test_a_report_scores_a_turn_that_waits_for_its_next_state_and_the_judge_is_not_asked():
    s = Stream()
    judge = Judge()
    p = NextStateProcessor(SCENARIO, judge=judge, batch_size=1)
    p.ingest(s.turn([u("q")], "a", session="S"))
    p.ingest(report("r1", ["t1"], 0.5, metadata={"why": "explicit"}, feedback="fine"))
    batch = p.pending_batch()
    smp = batch.samples[0]
    assert (smp.source_ids, smp.reward, smp.feedback, smp.report_id) == (["t1", "r1"], 0.5, "fine", "r1")
    assert smp.metadata["why"] == "explicit" and smp.metadata["reef"]["correlation"] == "report"
    assert judge.calls == [] and p.acknowledge(batch.batch_id) == ["t1", "r1"]
    # the session's next request finds no open turn to pair with: nothing trains twice
    p.ingest(s.turn([u("q"), a("a"), u("more")], "b", session="S"))
    assert not p.ready() and judge.calls == []


def test_a_report_wins_over_a_pending_judgement_and_replaces_a_judged_sample():
    s = Stream()
    judge = Judge({"t1": -1.0, "t3": -1.0})
    p = NextStateProcessor(SCENARIO, judge=judge, batch_size=3)
    p.ingest(s.turn([u("q")], "a", session="S"))
    p.ingest(s.turn([u("q"), a("a"), u("more")], "b", session="S"))  # pairs t1: waits for the judge
    p.ingest(report("r1", ["t1"], 1.0))
    p.ingest(s.turn([u("x")], "c", session="T"))
    p.ingest(s.turn([u("x"), a("c"), u("again")], "d", session="T"))  # pairs t3
    assert not p.ready()  # t1 scored by its report, t3 judged (-1): one sample short of a batch
    assert judge.calls == [("t3", "t4")]
    p.ingest(report("r3", ["t3"], 0.25))  # t3 was judged already: the report replaces the sample's score
    p.ingest(s.turn([u("y")], "e", session="U"))
    p.ingest(s.turn([u("y"), a("e"), u("ok")], "f", session="U"))  # pairs t5
    batch = p.pending_batch()
    assert [(smp.source_ids, smp.reward) for smp in batch.samples] == [
        (["t1", "r1"], 1.0), (["t3", "r3"], 0.25), (["t5"], 1.0)]
    assert batch.samples[1].metadata["reef"]["correlation"] == "report"
    assert sorted(p.acknowledge(batch.batch_id)) == ["r1", "r3", "t1", "t3", "t5"]
    p.ingest(report("r9", ["t1"], 1.0))  # trained already
    p.ingest(report("r10", ["nope"], 1.0))  # quotes nothing this processor holds
    p.ingest(report("r11", ["t4"], None))  # no score
    status = p.status()
    assert status["dropped"]["report_late"] == 1 and status["reports_ignored"] == 2


def test_without_a_judge_reports_still_train():
    s = Stream()
    p = NextStateProcessor(SCENARIO, judge=None, batch_size=1)
    p.ingest(s.turn([u("q")], "a", session="S"))
    p.ingest(s.turn([u("q"), a("a"), u("more")], "b", session="S"))
    assert not p.ready()
    p.ingest(report("r1", ["t1"], 1.0))
    batch = p.pending_batch()
    assert batch.samples[0].source_ids == ["t1", "r1"] and batch.samples[0].metadata["reef"]["next_record_id"] == "t2"
