"""Processors: record stream -> training batches (per-report, grouped), eligibility, dedup, recovery."""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import fields

import pytest

from reef_core.errors import ConfigError, NotFound
from reef_core.observe.model import Record
from reef_core.observe.processor import Batch, Processor
from reef_core.observe.processors import (
    GroupedProcessor,
    PerReportProcessor,
    conversation_of,
    merge_exchanges,
    parse_version,
    staleness_reason,
)
from reef_core.observe.records import RecordStore

SCENARIO = "s1"


class Stream:
    """Builds records of one scenario with increasing sequences, as the store would hand them out."""

    def __init__(self, scenario: str = SCENARIO):
        self.scenario = scenario
        self._seq = itertools.count(1)
        self._ids = itertools.count(1)

    def inference(self, messages, reply, *, version="inc:1", tags=None, complete=True, rid=None, tokens=None,
                  error=None, route="chat", tool_calls=None) -> Record:
        message = {"role": "assistant", "content": reply}
        if tool_calls:
            message["tool_calls"] = tool_calls
        payload = {"route": route, "dialect": "openai", "client_dialect": "openai", "stream": False,
                   "request": {"model": "m", "messages": messages},
                   "response": {"object": "chat.completion", "choices": [{"index": 0, "message": message}]},
                   "engine": "test", "timings": {}}
        if tokens is not None:
            payload["tokens"] = tokens
        if error:
            payload["error"] = error
        return Record(record_id=rid or f"inf-{next(self._ids)}", scenario=self.scenario, kind="inference",
                      payload=payload, tags=tags or {}, version=version, complete=complete,
                      sequence=next(self._seq))

    def anthropic(self, system, messages, reply_blocks, *, version="inc:1", rid=None) -> Record:
        payload = {"route": "messages", "dialect": "anthropic", "client_dialect": "anthropic", "stream": True,
                   "request": {"model": "m", "max_tokens": 64, "system": system, "messages": messages},
                   "response": {"type": "message", "role": "assistant", "content": reply_blocks},
                   "engine": "test", "timings": {}}
        return Record(record_id=rid or f"inf-{next(self._ids)}", scenario=self.scenario, kind="inference",
                      payload=payload, version=version, sequence=next(self._seq))

    def report(self, refs, score=1.0, *, metadata=None, feedback=None, rid=None, created_at=None) -> Record:
        payload = {}
        if score is not None:
            payload["score"] = score
        if metadata is not None:
            payload["metadata"] = metadata
        if feedback is not None:
            payload["feedback"] = feedback
        extra = {"created_at": created_at} if created_at is not None else {}
        return Record(record_id=rid or f"rep-{next(self._ids)}", scenario=self.scenario, kind="report",
                      payload=payload, references=list(refs), sequence=next(self._seq), **extra)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "be brief"}


def feed(processor, *records):
    for record in records:
        processor.ingest(record)
    return records


def three_turn_run(stream: Stream, versions=("inc:1", "inc:1", "inc:1")):
    """An agent run of three exchanges, each request resending the whole history."""
    a = stream.inference([SYSTEM, user("q1")], "a1", version=versions[0],
                         tokens={"prompt_ids": [1, 2], "output_ids": [3], "output_logprobs": [-0.5],
                                 "version": versions[0]})
    b = stream.inference([SYSTEM, user("q1"), assistant("a1"), user("q2")], "a2", version=versions[1])
    c = stream.inference([SYSTEM, user("q1"), assistant("a1"), user("q2"), assistant("a2"), user("q3")], "a3",
                         version=versions[2])
    return a, b, c


# -- conversation normalisation ---------------------------------------------------------------------------------------


def test_conversation_of_openai_normalises_parts_roles_and_tool_calls():
    s = Stream()
    record = s.inference(
        [{"role": "developer", "content": "rules"},
         {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "image_url", "image_url": {}},
                                      {"type": "text", "text": "there"}]},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"b": 1, "a": 2}'}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "42"}],
        "done")
    messages, text = conversation_of(record)
    assert text == "done"
    assert messages == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":2,"b":1}'}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]


def test_conversation_of_anthropic_system_blocks_tool_use_and_results():
    s = Stream()
    record = s.anthropic(
        [{"type": "text", "text": "sys "}, {"type": "text", "text": "prompt"}],
        [{"role": "user", "content": "weather?"},
         {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm"},
                                           {"type": "text", "text": "checking"},
                                           {"type": "tool_use", "id": "t1", "name": "wx", "input": {"city": "Oslo"}}]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                       "content": [{"type": "text", "text": "rain"}]},
                                      {"type": "text", "text": "so?"}]}],
        [{"type": "text", "text": "Take "}, {"type": "text", "text": "an umbrella."}])
    messages, text = conversation_of(record)
    assert text == "Take an umbrella."
    assert messages == [
        {"role": "system", "content": "sys prompt"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "checking",
         "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "wx", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "rain"},
        {"role": "user", "content": "so?"},
    ]


# -- versions and staleness -------------------------------------------------------------------------------------------


def test_parse_version_format():
    assert parse_version("base") == ("base", 0)
    assert parse_version("a1b2:7") == ("a1b2", 7)
    assert parse_version("host:pid:12") == ("host:pid", 12)  # the incarnation is everything before the last colon
    for bad in ("", "7", "inc:", ":3", "inc:-1", "inc:x", "inc:٣"):
        with pytest.raises(ValueError):
            parse_version(bad)


@pytest.mark.parametrize("producing,serving,window,expected", [
    ("i:5", "i:5", 0, None),
    ("i:4", "i:5", 0, "stale"),
    ("i:4", "i:5", 1, None),
    ("i:3", "i:5", 1, "stale"),
    ("i:3", "i:5", 2, None),
    ("j:5", "i:5", 9, "cross_incarnation"),
    ("base", "i:1", 9, "cross_incarnation"),
    ("i:6", "i:5", 9, "future_version"),
    (None, "i:5", 9, "unknown_version"),
    ("release-abc", "release-abc", 0, None),
    ("release-abc", "i:5", 3, "unknown_version"),
])
def test_staleness_reason(producing, serving, window, expected):
    assert staleness_reason(producing, serving, window) == expected


# -- per-report: merging ----------------------------------------------------------------------------------------------


def test_report_quoting_three_receipts_is_one_three_turn_sample_without_repeated_history():
    s = Stream()
    p = PerReportProcessor(SCENARIO)
    a, b, c = feed(p, *three_turn_run(s, versions=("inc:1", "inc:1", "inc:2")))
    report = s.report([a.record_id, b.record_id, c.record_id], 0.75, feedback="good", metadata={"task": "t"})
    p.ingest(report)
    assert p.ready()
    batch = p.pending_batch()
    assert len(batch.samples) == 1
    sample = batch.samples[0]
    assert sample.messages == [SYSTEM, user("q1"), assistant("a1"), user("q2"), assistant("a2"), user("q3"),
                               assistant("a3")]
    assert [seg.message_index for seg in sample.segments] == [2, 4, 6]
    assert sample.references == [a.record_id, b.record_id, c.record_id]
    assert sample.versions == ["inc:1", "inc:1", "inc:2"]
    assert sample.tokens[0]["output_ids"] == [3] and sample.tokens[1:] == [None, None]
    assert all(seg.context_start == 0 for seg in sample.segments)
    assert sample.reward == 0.75 and sample.feedback == "good" and sample.metadata["task"] == "t"
    assert sample.metadata["reef"]["contiguous"] is True
    assert sample.source_ids == [a.record_id, b.record_id, c.record_id, report.record_id]
    assert sample.prompt == sample.messages[:6] and sample.completion == "a3"
    assert batch.record_ids == sample.source_ids


def test_reference_order_decides_turn_order_and_rewritten_history_starts_a_new_context():
    s = Stream()
    first = s.inference([user("q1")], "a1")
    compacted = s.inference([SYSTEM, user("summary of q1/a1"), user("q2")], "a2")
    messages, segments, contiguous = merge_exchanges([first, compacted])
    assert not contiguous
    assert messages == [user("q1"), assistant("a1"), SYSTEM, user("summary of q1/a1"), user("q2"), assistant("a2")]
    assert [(g.context_start, g.message_index) for g in segments] == [(0, 1), (2, 5)]
    # every turn keeps exactly the prompt its model saw
    assert messages[segments[1].context_start:segments[1].message_index] == conversation_of(compacted)[0]


def test_merge_tolerates_whitespace_and_tool_argument_formatting_in_resent_history():
    s = Stream()
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]
    a = s.inference([user("go")], "  thinking  ", tool_calls=call)
    resent = {"role": "assistant", "content": "thinking", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}]}
    b = s.inference([user("go"), resent, {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "done")
    messages, segments, contiguous = merge_exchanges([a, b])
    assert contiguous and len(messages) == 4 and [g.message_index for g in segments] == [1, 3]


def test_anthropic_agent_loop_merges_its_tool_turns_contiguously():
    s = Stream()
    call = [{"type": "thinking", "thinking": "plan"}, {"type": "text", "text": "checking"},
            {"type": "tool_use", "id": "t1", "name": "wx", "input": {"city": "Oslo", "unit": "C"}}]
    first = s.anthropic("sys", [{"role": "user", "content": "weather?"}], call)
    resent = [{"type": "text", "text": "checking"},
              {"type": "tool_use", "id": "t1", "name": "wx", "input": {"unit": "C", "city": "Oslo"}}]
    second = s.anthropic("sys", [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": resent},
                                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                               "content": "rain"}]}],
                         [{"type": "text", "text": "Umbrella."}])
    p = PerReportProcessor(SCENARIO)
    feed(p, first, second, s.report([first.record_id, second.record_id], 1.0))
    sample = p.pending_batch().samples[0]
    assert sample.metadata["reef"]["contiguous"] is True
    assert [m["role"] for m in sample.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert [g.message_index for g in sample.segments] == [2, 4] and sample.completion == "Umbrella."
    assert json.loads(json.dumps(p.pending_batch().to_dict()))["samples"][0]["reward"] == 1.0
    assert json.dumps(p.status())


# -- per-report: batches ----------------------------------------------------------------------------------------------


def test_batch_lifecycle_same_batch_until_acknowledged_release_and_drop():
    s = Stream()
    p = PerReportProcessor(SCENARIO, batch_size=2)
    assert isinstance(p, Processor)
    infs = [s.inference([user(f"q{i}")], f"a{i}") for i in range(5)]
    feed(p, *infs)
    reports = [s.report([inf.record_id], float(i)) for i, inf in enumerate(infs)]
    p.ingest(reports[0])
    assert not p.ready() and p.pending_batch() is None
    feed(p, *reports[1:])
    batch = p.pending_batch()
    assert isinstance(batch, Batch) and p.pending_batch() is batch
    assert [smp.reward for smp in batch.samples] == [0.0, 1.0]

    p.release(batch.batch_id)
    again = p.pending_batch()
    assert [smp.reward for smp in again.samples] == [0.0, 1.0]  # released units keep their place
    with pytest.raises(NotFound):
        p.acknowledge("nope")
    consumed = p.acknowledge(again.batch_id)
    assert consumed == [infs[0].record_id, reports[0].record_id, infs[1].record_id, reports[1].record_id]
    assert p.acknowledge(again.batch_id) == consumed  # a retried acknowledgement answers the same

    second = p.pending_batch()
    assert [smp.reward for smp in second.samples] == [2.0, 3.0]
    dropped = p.drop(second.batch_id, "fence_moved")
    assert dropped == [infs[2].record_id, reports[2].record_id, infs[3].record_id, reports[3].record_id]
    status = p.status()
    assert status["dropped"] == {"fence_moved": 2}
    assert status["batches_acknowledged"] == 1 and status["samples_acknowledged"] == 2
    assert status["batches_dropped"] == 1 and status["batches_released"] == 1
    assert status["consumed"] == 8 and status["pending_units"] == 1 and status["ready"] is False
    assert status["last_sequence"] == reports[-1].sequence


def test_unusable_reports_are_counted_by_reason():
    s = Stream()
    p = PerReportProcessor(SCENARIO)
    ok = s.inference([user("q")], "a")
    partial = s.inference([user("q")], "a", complete=False)
    failed = s.inference([user("q")], "a", error="upstream 500")
    tokens_only = s.inference([user("q")], "a", route="count_tokens")
    feed(p, ok, partial, failed, tokens_only)
    feed(p,
         s.report([]),  # no references
         s.report([ok.record_id], score=None),  # no score
         s.report([ok.record_id], score=True),  # booleans are not scores
         s.report([partial.record_id]),
         s.report([failed.record_id]),
         s.report([tokens_only.record_id]),
         s.report(["never-ingested"]))
    assert p.status()["dropped"] == {"incomplete": 2, "no_references": 1, "no_score": 2, "not_chat": 1,
                                     "unknown_reference": 1}
    assert not p.ready()
    lenient = PerReportProcessor(SCENARIO, require_score=False)
    feed(lenient, ok, s.report([ok.record_id], score=None))
    assert lenient.pending_batch().samples[0].reward is None


def test_duplicate_report_keeps_the_first_and_consumed_receipts_never_train_twice():
    s = Stream()
    p = PerReportProcessor(SCENARIO)
    inf = s.inference([user("q")], "a")
    first, second = s.report([inf.record_id], 1.0), s.report([inf.record_id], 0.0)
    feed(p, inf, first, second)
    batch = p.pending_batch()
    assert batch.samples[0].report_id == first.record_id and batch.samples[0].reward == 1.0
    assert p.status()["dropped"] == {"duplicate": 1}
    p.acknowledge(batch.batch_id)
    p.ingest(s.report([inf.record_id], 0.5))  # a retry under a new id after training
    assert not p.ready() and p.status()["dropped"] == {"already_consumed": 1, "duplicate": 1}
    # The same record delivered twice (replay overlapping live ingestion) is ignored.
    p.ingest(first)
    assert p.status()["dropped"] == {"already_consumed": 1, "duplicate": 1}


def test_dropped_units_free_their_receipts_for_a_later_report():
    s = Stream()
    serving = {"v": "inc:1"}
    p = PerReportProcessor(SCENARIO, max_staleness=0, serving_version=lambda: serving["v"], require_score=True)
    inf = s.inference([user("q")], "a", version="inc:1")
    feed(p, inf, s.report([inf.record_id], 1.0))
    serving["v"] = "inc:2"
    assert not p.ready()
    assert p.status()["dropped"] == {"stale": 1}
    assert p.protected_ids() == set()


def test_accept_report_filter():
    s = Stream()
    p = PerReportProcessor(SCENARIO, accept_report=lambda r: r.payload["score"] < 0.5)
    inf1, inf2 = s.inference([user("x")], "a"), s.inference([user("y")], "b")
    feed(p, inf1, inf2, s.report([inf1.record_id], 0.9), s.report([inf2.record_id], 0.1))
    assert [smp.reward for smp in p.pending_batch().samples] == [0.1]
    assert p.status()["dropped"] == {"filtered": 1}


# -- staleness in processors -------------------------------------------------------------------------------------------


def _staleness_run(max_staleness: int):
    s = Stream()
    p = PerReportProcessor(SCENARIO, batch_size=1, max_staleness=max_staleness, serving_version=lambda: "inc:5")
    old = s.inference([user("old")], "a", version="inc:3")  # v - 2
    new = s.inference([user("new")], "b", version="inc:5")
    feed(p, old, new, s.report([old.record_id], 0.1), s.report([new.record_id], 0.9))
    rewards = []
    while (batch := p.pending_batch()) is not None:
        rewards += [smp.reward for smp in batch.samples]
        p.acknowledge(batch.batch_id)
    return rewards, p.status()["dropped"]


def test_staleness_window_drops_v_minus_2_at_window_1_and_keeps_it_at_window_2():
    assert _staleness_run(1) == ([0.9], {"stale": 1})
    assert _staleness_run(2) == ([0.1, 0.9], {})


def test_one_stale_turn_makes_a_trajectory_inadmissible_and_other_incarnations_never_train():
    s = Stream()
    p = PerReportProcessor(SCENARIO, max_staleness=1, serving_version=lambda: "inc:3")
    a, b, c = feed(p, *three_turn_run(s, versions=("inc:1", "inc:3", "inc:3")))
    other = s.inference([user("z")], "z", version="old:3")
    future = s.inference([user("f")], "f", version="inc:4")
    feed(p, other, future, s.report([a.record_id, b.record_id, c.record_id]), s.report([other.record_id]),
         s.report([future.record_id]))
    assert not p.ready()
    assert p.status()["dropped"] == {"cross_incarnation": 1, "future_version": 1, "stale": 1}


def test_units_wait_while_the_serving_version_is_unknown():
    s = Stream()
    serving = {"v": None}
    p = PerReportProcessor(SCENARIO, max_staleness=0, serving_version=lambda: serving["v"])
    inf = s.inference([user("q")], "a", version="inc:2")
    feed(p, inf, s.report([inf.record_id]))
    assert not p.ready() and p.pending_batch() is None
    assert p.status()["waiting_for_serving_version"] is True
    serving["v"] = "inc:2"
    assert p.ready() and p.pending_batch().samples[0].versions == ["inc:2"]


def test_released_batch_is_rechecked_against_the_serving_version():
    s = Stream()
    serving = {"v": "inc:1"}
    p = PerReportProcessor(SCENARIO, max_staleness=0, serving_version=lambda: serving["v"])
    inf = s.inference([user("q")], "a", version="inc:1")
    feed(p, inf, s.report([inf.record_id]))
    batch = p.pending_batch()
    serving["v"] = "inc:2"
    assert p.pending_batch() is batch  # a reserved batch is stable; the learner's fence decides
    p.release(batch.batch_id)
    assert p.pending_batch() is None and p.status()["dropped"] == {"stale": 1}


# -- recovery with the real record store ------------------------------------------------------------------------------


def test_restart_restores_consumed_ids_and_replay_trains_nothing_twice(tmp_path):
    store = RecordStore.open(None, tmp_path)
    try:
        s = Stream()
        stored = []
        for record in [*three_turn_run(s), s.inference([user("solo")], "x")]:
            stored.append(store.append_sync(record.__class__(**{**record.__dict__, "sequence": None})))
        a, b, c, solo = stored
        report = store.append_sync(Record(record_id="r1", scenario=SCENARIO, kind="report", payload={"score": 1.0},
                                          references=[a.record_id, b.record_id, c.record_id]))
        first = PerReportProcessor(SCENARIO)
        feed(first, *store.replay(SCENARIO))
        batch = first.pending_batch()
        store.mark_consumed(SCENARIO, first.acknowledge(batch.batch_id), step=1)

        # A client retry of the same report under a new id, and a fresh report, arrive after the restart.
        retry = store.append_sync(Record(record_id="r1-retry", scenario=SCENARIO, kind="report",
                                         payload={"score": 0.2}, references=[b.record_id]))
        fresh = store.append_sync(Record(record_id="r2", scenario=SCENARIO, kind="report", payload={"score": 0.5},
                                         references=[solo.record_id]))
        restarted = PerReportProcessor(SCENARIO)
        restarted.restore(store.consumed_ids(SCENARIO))
        feed(restarted, *store.replay(SCENARIO))
        batch = restarted.pending_batch()
        assert [smp.report_id for smp in batch.samples] == [fresh.record_id]
        restarted.acknowledge(batch.batch_id)
        assert restarted.pending_batch() is None
        status = restarted.status()
        assert status["dropped"] == {"already_consumed": 1}  # the retry
        assert status["replayed_consumed"] == 1  # the report that trained before the restart
        assert retry.record_id not in store.consumed_ids(SCENARIO) and report.record_id in store.consumed_ids(SCENARIO)
    finally:
        store.close()


def test_restore_after_ingest_evicts_units_that_already_trained():
    s = Stream()
    p = PerReportProcessor(SCENARIO)
    inf = s.inference([user("q")], "a")
    rep = s.report([inf.record_id])
    feed(p, inf, rep)
    p.restore({inf.record_id, rep.record_id})
    assert not p.ready() and p.status()["pending_units"] == 0


# -- grouped ----------------------------------------------------------------------------------------------------------


def _rollouts(s: Stream, prompt: str, n: int, version="inc:1"):
    return [s.inference([user(prompt)], f"{prompt}-answer-{i}", version=version) for i in range(n)]


def test_grouped_by_prompt_releases_complete_groups_in_order():
    s = Stream()
    p = GroupedProcessor(SCENARIO, group_size=3)
    xs, ys = _rollouts(s, "x", 3), _rollouts(s, "y", 3)
    feed(p, *xs, *ys)
    feed(p, s.report([xs[0].record_id], 1.0), s.report([ys[0].record_id], 0.0), s.report([xs[1].record_id], 0.0),
         s.report([ys[1].record_id], 1.0))
    assert not p.ready() and p.status()["open_groups"] == 2 and json.dumps(p.status())
    p.ingest(s.report([ys[2].record_id], 0.5))
    batch = p.pending_batch()
    assert [smp.completion for smp in batch.samples] == ["y-answer-0", "y-answer-1", "y-answer-2"]
    assert len({smp.group_key for smp in batch.samples}) == 1 and batch.samples[0].group_key.startswith("prompt:")
    assert batch.samples[0].metadata["reef"]["group_size"] == 3
    assert batch.samples[0].metadata["reef"]["partial"] is False
    p.acknowledge(batch.batch_id)
    p.ingest(s.report([xs[2].record_id], 1.0))
    assert [smp.completion for smp in p.pending_batch().samples] == ["x-answer-0", "x-answer-1", "x-answer-2"]


def test_grouped_by_task_with_slots_and_several_groups_per_batch():
    s = Stream()
    p = GroupedProcessor(SCENARIO, group_size=2, key="task", groups_per_batch=2, slot="metadata.rollout")
    infs = [s.inference([user(f"q{i}")], f"a{i}") for i in range(6)]
    feed(p, *infs)
    feed(p,
         s.report([infs[0].record_id], metadata={"task": "t1", "rollout": 0}),
         s.report([infs[1].record_id], metadata={"task": "t1", "rollout": 0}),  # same slot: duplicate
         s.report([infs[2].record_id], metadata={"task": "t1", "rollout": 1}),
         s.report([infs[3].record_id], metadata={"harbor": {"task_name": "t2"}, "rollout": 0}),
         s.report([infs[4].record_id], metadata={"other": 1}))  # no key
    assert not p.ready()
    p.ingest(s.report([infs[5].record_id], metadata={"task": "t2", "rollout": 1}))
    batch = p.pending_batch()
    assert [smp.group_key for smp in batch.samples] == ["t1", "t1", "t2", "t2"]
    assert p.status()["dropped"] == {"duplicate": 1, "no_group_key": 1}
    p.release(batch.batch_id)
    assert p.status()["ready_groups"] == 2
    assert [smp.group_key for smp in p.pending_batch().samples] == ["t1", "t1", "t2", "t2"]


class FakeClock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


@pytest.mark.parametrize("policy", ["wait", "drop_after_s", "release_partial"])
def test_grouped_partial_group_policy(policy):
    s = Stream()
    clock = FakeClock()
    timeout = None if policy == "wait" else 60.0
    p = GroupedProcessor(SCENARIO, group_size=4, partial_policy=policy, timeout_s=timeout, clock=clock)
    xs = _rollouts(s, "x", 2)
    feed(p, *xs, *(s.report([x.record_id], created_at=clock.now) for x in xs))
    clock.now += 59
    assert not p.ready()
    # The learner sleeps until a record arrives: the processor says when the timeout needs a look.
    assert p.recheck_after() == (None if policy == "wait" else pytest.approx(1.0))
    clock.now += 2
    if policy == "wait":
        assert not p.ready() and p.status()["open_groups"] == 1
    elif policy == "drop_after_s":
        assert not p.ready() and p.status()["dropped"] == {"group_timeout": 2}
        # the receipts are free again: a later complete group may use other rollouts of the prompt
        assert p.status()["open_groups"] == 0 and p.protected_ids() == set()
    else:
        batch = p.pending_batch()
        assert len(batch.samples) == 2 and all(smp.metadata["reef"]["partial"] for smp in batch.samples)


def test_release_partial_respects_min_partial_size():
    s = Stream()
    clock = FakeClock()
    p = GroupedProcessor(SCENARIO, group_size=4, partial_policy="release_partial", timeout_s=10,
                         min_partial_size=2, clock=clock)
    (x,) = _rollouts(s, "x", 1)
    feed(p, x, s.report([x.record_id], created_at=clock.now))
    clock.now += 11
    assert not p.ready() and p.status()["dropped"] == {"group_timeout": 1}


def test_group_with_an_inadmissible_member_is_discarded_whole():
    s = Stream()
    p = GroupedProcessor(SCENARIO, group_size=3, max_staleness=1, serving_version=lambda: "inc:4")
    a = s.inference([user("x")], "a", version="inc:4")
    b = s.inference([user("x")], "b", version="inc:3")
    c = s.inference([user("x")], "c", version="inc:2")  # two versions behind: the group mixes too far
    feed(p, a, b, c, *(s.report([r.record_id]) for r in (a, b, c)))
    assert not p.ready()
    assert p.status()["dropped"] == {"group_discarded": 2, "stale": 1}


def test_grouped_rejects_bad_configuration():
    with pytest.raises(ValueError):
        GroupedProcessor(SCENARIO, group_size=2, partial_policy="drop_after_s")  # no timeout
    with pytest.raises(ValueError):
        GroupedProcessor(SCENARIO, group_size=2, key="colour")
    with pytest.raises(ValueError):
        GroupedProcessor(SCENARIO, group_size=2, partial_policy="sometimes", timeout_s=1)


# -- stream dedup -----------------------------------------------------------------------------------------------------


def test_records_seen_twice_or_out_of_order_are_ingested_exactly_once():
    from reef_core.observe.processors.base import SeenRecords

    s = Stream()
    inf = s.inference([user("q")], "a")  # sequence 1
    rep = s.report([inf.record_id])  # sequence 2
    p = PerReportProcessor(SCENARIO)
    feed(p, rep, inf, inf, rep)  # live notifications of one group commit may run in any order
    assert p.status()["records_ingested"] == 2 and p.last_sequence == 2
    # the report arrived before its inference: it could not be assembled, and is counted, not lost silently
    assert p.status()["dropped"] == {"unknown_reference": 1}

    seen = SeenRecords(window=3)
    order = [2, 3, 1, 5, 6, 7, 8, 4, 9]
    fresh = [seen.first_time(Record(record_id=f"r{n}", scenario=SCENARIO, kind="inference", payload={}, sequence=n))
             for n in order]
    # 4 never came before the window of early arrivals overflowed: the floor moved past it
    assert fresh == [True, True, True, True, True, True, True, False, True] and seen.floor == 9


# -- thread safety ----------------------------------------------------------------------------------------------------


def test_ingest_on_one_thread_while_another_acknowledges():
    s = Stream()
    p = PerReportProcessor(SCENARIO, batch_size=3)
    records = []
    for i in range(300):
        inf = s.inference([user(f"q{i}")], f"a{i}")
        records += [inf, s.report([inf.record_id], float(i))]
    done = threading.Event()
    consumed: list[str] = []
    errors: list[BaseException] = []

    def learner():
        try:
            while True:
                batch = p.pending_batch()
                if batch is None:
                    if done.is_set() and not p.ready():
                        return
                    done.wait(0.001)  # yield the GIL to the ingesting thread; correctness does not depend on it
                    continue
                consumed.extend(p.acknowledge(batch.batch_id))
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=learner)
    thread.start()
    feed(p, *records)
    done.set()
    thread.join(timeout=30)
    assert not thread.is_alive() and not errors
    assert sorted(consumed) == sorted(r.record_id for r in records)  # every record exactly once
    assert p.status()["samples_acknowledged"] == 300


# -- registration -----------------------------------------------------------------------------------------------------


def test_builtin_factories_are_registered_and_validate_options():
    from reef_core.plugins import PluginManager

    pm = PluginManager(load_entry_points=False)
    s = Stream()
    per_report = pm.get("processor", "per_report").factory(
        scenario=SCENARIO, options={"batch-size": 2, "max_staleness": 1}, serving_version=lambda: "inc:1")
    assert isinstance(per_report, PerReportProcessor) and per_report.batch_size == 2
    grouped = pm.get("processor", "grouped").factory(
        scenario=SCENARIO, options={"group_size": 2, "key": "task", "partial_policy": "release_partial",
                                    "timeout_s": 5}, serving_version=lambda: None, store=object())
    assert grouped.status()["partial_policy"] == "release_partial"
    judge = pm.get("processor", "next_state").factory(
        scenario=SCENARIO, options={"judge": "math:fabs", "batch_size": 1}, serving_version=lambda: None)
    assert judge.judge is not None
    with pytest.raises(ConfigError, match="no option"):
        pm.get("processor", "per_report").factory(scenario=SCENARIO, options={"bach_size": 2},
                                                  serving_version=lambda: None)
    with pytest.raises(ConfigError, match="batch_size"):
        pm.get("processor", "per_report").factory(scenario=SCENARIO, options={"batch_size": 0},
                                                  serving_version=lambda: None)
    with pytest.raises(ConfigError, match="group_size"):
        pm.get("processor", "grouped").factory(scenario=SCENARIO, options={}, serving_version=lambda: None)
    with pytest.raises(ConfigError):
        pm.get("processor", "per_report").factory(scenario=SCENARIO, options={"max_staleness": -1},
                                                  serving_version=lambda: None)
    per_report.ingest(s.inference([user("q")], "a"))


@pytest.mark.parametrize("kind", ["per_report", "grouped"])
def test_held_inferences_keep_no_bodies_and_are_read_back_for_a_sample(kind):
    stream = Stream()
    stored: dict[str, Record] = {}
    reads: list[list[str]] = []

    def load_records(ids):
        reads.append(list(ids))
        return [stored.get(i) for i in ids]

    extra = {"group_size": 1} if kind == "grouped" else {}
    cls = PerReportProcessor if kind == "per_report" else GroupedProcessor
    proc = cls(SCENARIO, load_records=load_records, **extra)
    big = "x" * 10_000
    inferences = [stream.inference([user(f"q{i} {big}")], f"a{i}") for i in range(200)]
    for record in inferences:
        stored[record.record_id] = record
        proc.ingest(record)
    # What the processor keeps per waiting inference is a few fields, never a payload.
    held = list(proc._inferences.values())
    assert len(held) == 200 and not any(isinstance(h, Record) or hasattr(h, "payload") for h in held)
    assert proc._bodies is None
    assert all(isinstance(getattr(h, f.name), (str, int, float, type(None))) for h in held for f in fields(h))
    assert not reads
    proc.ingest(stream.report([inferences[7].record_id], 0.5))
    assert reads == [[inferences[7].record_id]]
    batch = proc.pending_batch()
    assert batch is not None and batch.samples[0].messages[0]["content"] == f"q7 {big}"
    # A quoted record the store no longer has never trains.
    del stored[inferences[8].record_id]
    proc.ingest(stream.report([inferences[8].record_id], 0.5))
    assert proc.status()["dropped"].get("unknown_reference") == 1


def test_close_batch_forms_a_partial_batch_of_the_reports_stored_before_it():
    s = Stream()
    p = PerReportProcessor(SCENARIO, batch_size=5, require_score=False)
    first = [s.inference([{"role": "user", "content": f"q{i}"}], f"a{i}") for i in range(3)]
    for inf in first:
        p.ingest(inf)
    reports = [s.report([first[0].record_id], 1.0), s.report([first[1].record_id], None,
                                                            metadata={"unscored": True})]
    for rep in reports:
        p.ingest(rep)
    assert not p.ready()
    assert p.close_batch(reports[-1].sequence) == 2
    # A report stored after the close belongs to the next day.
    late = s.report([first[2].record_id], 0.0)
    p.ingest(late)
    batch = p.pending_batch()
    assert batch is not None and [x.report_id for x in batch.samples] == [r.record_id for r in reports]
    assert [x.reward for x in batch.samples] == [1.0, None]  # the unscored sentinel stays None, never a 0
    p.acknowledge(batch.batch_id)
    assert not p.ready() and p.status()["close_through"] is None and p.status()["batches_closed_early"] == 1
    assert p.status()["pending_units"] == 1


def test_close_batch_waits_for_reports_not_yet_ingested():
    s = Stream()
    p = PerReportProcessor(SCENARIO, batch_size=5)
    inf = s.inference([{"role": "user", "content": "q"}], "a")
    rep = s.report([inf.record_id], 0.5)
    p.ingest(inf)
    p.close_batch(rep.sequence)  # the report is stored, not ingested yet: the close holds
    assert not p.ready() and p.status()["close_through"] == rep.sequence
    p.ingest(rep)
    assert p.ready() and len(p.pending_batch().samples) == 1
    with pytest.raises(ValueError):
        p.close_batch(-1)


def test_store_last_sequence(tmp_path):
    store = RecordStore.open(None, tmp_path)
    try:
        assert store.last_sequence(SCENARIO) == 0
        s = Stream()
        stored = store.append_many_sync([s.inference([{"role": "user", "content": "q"}], "a"),
                                         s.inference([{"role": "user", "content": "r"}], "b")])
        assert store.last_sequence(SCENARIO) == max(r.sequence for r in stored)
        assert store.last_sequence("other") == 0
    finally:
        store.close()
