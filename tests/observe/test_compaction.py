"""Record retention on the store (SQLite and PostgreSQL): the eligibility rule, counts, idempotent reruns, the
in-transaction re-check, and a kill mid-pass (a subprocess at a crash point) losing no receipt, score or pending
sample."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from reef_core.observe.compacted import compaction_of, is_compacted
from reef_core.observe.compaction import CompactionPolicy, compaction_counts, plan_compaction, run_compaction
from reef_core.observe.processors.eligibility import COMPACTED, unusable_reason
from reef_core.observe.records import Record, RecordStore

OLD = time.time() - 10 * 86400


def inference(i: int, *, created_at: float = OLD, scenario: str = "s") -> Record:
    return Record(record_id=f"r{i}", scenario=scenario, kind="inference", created_at=created_at, payload={
        "route": "chat", "dialect": "openai", "request": {"messages": [{"role": "user", "content": "q" * 400}]},
        "response": {"model": "m", "usage": {"prompt_tokens": 7, "completion_tokens": 3},
                     "choices": [{"message": {"role": "assistant", "content": "a" * 400}}]},
        "tokens": {"prompt_ids": [1] * 7, "output_ids": [2] * 3}, "timings": {"engine_ms": 1.0}},
        top_k=b"\x00" * 64)


def report(rid: str, refs: list[str], scenario: str = "s") -> Record:
    return Record(record_id=rid, scenario=scenario, kind="report", payload={"score": 0.5}, references=refs)


@pytest.fixture
def store(tmp_path, records_database):
    url, options = records_database
    with RecordStore.open(url, tmp_path, **options) as opened:
        opened.get_or_create_scenario("s", "none")
        yield opened


def compact(store, protected=None, **policy):
    plan = plan_compaction(store, {"s": CompactionPolicy(**policy)}, protected=protected)
    return run_compaction(store, plan, chunk_records=3, protected=protected)


def test_the_eligibility_rule(store):
    store.append_many_sync([inference(i) for i in range(8)] + [inference(8, created_at=time.time())])
    store.append_sync(report("scored", ["r0"]))  # consumed below with r0: keep_scored keeps r0's body
    store.append_sync(report("pending", ["r1"]))  # unconsumed: a pending sample (or replay task) needs r1
    store.mark_consumed("s", ["r0", "scored", "r2"], step=1)
    result = compact(store, protected=lambda s: {"r3"}, max_age_s=86400)  # r3: a live processor holds it
    reasons = {r: store.get("s", r) for r in ("r0", "r1", "r2", "r3", "r4", "r8")}
    assert [r for r, rec in reasons.items() if is_compacted(rec)] == ["r2", "r4"]
    assert compaction_of(reasons["r2"])["reason"] == "consumed"
    assert compaction_of(reasons["r4"])["reason"] == "expired"
    assert result.counts["s"]["consumed"]["records"] == 1 and result.counts["s"]["expired"]["records"] == 4
    # Reports are never compacted; receipts, hashes and token counts stay.
    assert store.get("s", "scored").payload == {"score": 0.5}
    kept = store.get("s", "r2")
    assert kept.content_hash == inference(2).content_hash and kept.top_k is None and kept.sequence == 3
    assert kept.payload["usage"] == {"prompt_tokens": 7, "completion_tokens": 3}
    assert kept.payload["token_counts"] == {"prompt_tokens": 7, "output_tokens": 3}
    assert "request" not in kept.payload and "response" not in kept.payload and "tokens" not in kept.payload
    assert unusable_reason(kept) == COMPACTED
    assert compaction_counts(store)["s"]["expired"]["records"] == 4
    # keep_scored=false: the consumed scored record goes too; the pending one still stays.
    compact(store, keep_scored=False)
    assert is_compacted(store.get("s", "r0")) and not is_compacted(store.get("s", "r1"))


def test_a_rerun_is_idempotent_and_counts_once(store):
    store.append_many_sync([inference(i) for i in range(5)])
    plan = plan_compaction(store, {"s": CompactionPolicy(max_age_s=60)})
    first = run_compaction(store, plan, chunk_records=2)
    again = run_compaction(store, plan, chunk_records=2)  # the same plan replayed (a crash before it ended)
    assert first.total() == 5 and again.total() == 0 and again.skipped == 5
    assert compaction_counts(store)["s"]["expired"]["records"] == 5
    assert plan_compaction(store, {"s": CompactionPolicy(max_age_s=60)}).candidates == []


def test_a_report_stored_after_the_plan_protects_its_receipt(store):
    store.append_many_sync([inference(i) for i in range(3)])
    plan = plan_compaction(store, {"s": CompactionPolicy(max_age_s=60)})
    store.append_sync(report("late", ["r1"]))  # between plan and run
    run_compaction(store, plan)
    assert is_compacted(store.get("s", "r0")) and not is_compacted(store.get("s", "r1"))


def test_max_bytes_compacts_the_oldest_first(store):
    store.append_many_sync([inference(i, created_at=OLD + i) for i in range(6)])
    body = plan_compaction(store, {"s": CompactionPolicy()}).body_bytes["s"] // 6
    compact(store, max_bytes=body * 2)
    assert [is_compacted(store.get("s", f"r{i}")) for i in range(6)] == [True] * 4 + [False] * 2
    assert compaction_counts(store)["s"]["max_bytes"]["records"] == 4
    # The deployment-wide budget spans scenarios.
    store.get_or_create_scenario("t", "none")
    store.append_many_sync([inference(i, created_at=OLD - 1, scenario="t") for i in range(2)])
    plan = plan_compaction(store, {"s": CompactionPolicy(), "t": CompactionPolicy()}, total_max_bytes=body * 2)
    assert [(c.scenario, c.record_id) for c in plan.candidates] == [("t", "r0"), ("t", "r1")]


def test_dry_run_writes_nothing(store):
    store.append_many_sync([inference(i) for i in range(3)])
    plan = plan_compaction(store, {"s": CompactionPolicy(max_age_s=60)})
    result = run_compaction(store, plan, dry_run=True)
    assert result.total() == 3 and result.total("bytes_after") < result.total("bytes_before")
    assert not any(is_compacted(store.get("s", f"r{i}")) for i in range(3)) and compaction_counts(store) == {}


CHILD = textwrap.dedent("""
    import sys
    from reef_core.commit.crashpoints import crash_point
    from reef_core.observe.compaction import CompactionPolicy, plan_compaction, run_compaction
    from reef_core.observe.records import RecordStore
    url = sys.argv[2] if sys.argv[2] != "-" else None
    options = {"schema": sys.argv[3]} if sys.argv[3] != "-" else {}
    with RecordStore.open(url, sys.argv[1], **options) as store:
        plan = plan_compaction(store, {"s": CompactionPolicy(max_age_s=60, keep_scored=False)})
        run_compaction(store, plan, chunk_records=10, in_chunk=lambda: crash_point("in_compaction_chunk"),
                       after_chunk=lambda n: crash_point("after_compaction_chunk") if n >= 20 else None)
""")


@pytest.mark.parametrize("point", ["in_compaction_chunk", "after_compaction_chunk"])
def test_a_kill_mid_pass_loses_nothing_and_a_rerun_finishes(tmp_path, records_database, point):
    url, options = records_database
    with RecordStore.open(url, tmp_path, **options) as store:
        store.get_or_create_scenario("s", "none")
        store.append_many_sync([inference(i) for i in range(50)])
        store.append_sync(report("done", ["r0"]))
        store.append_sync(report("waiting", ["r1"]))  # a pending sample: never compacted
        store.mark_consumed("s", ["r0", "done"], 1)
        hashes = {r.record_id: r.content_hash for r in store.replay("s")}
    args = [sys.executable, "-c", CHILD, str(tmp_path), url or "-", options.get("schema", "-")]
    killed = subprocess.run(args, env={**os.environ, "REEF_CRASH_AT": point}, capture_output=True, timeout=120)
    assert killed.returncode == 137, killed.stderr.decode()
    with RecordStore.open(url, tmp_path, **options) as store:
        done = [r for r in store.replay("s") if is_compacted(r)]
        counted = sum(row["records"] for row in compaction_counts(store).get("s", {}).values())
        # Whole chunks only, and counted in the same transaction.
        assert len(done) == counted == (0 if point == "in_compaction_chunk" else 20)
    finished = subprocess.run(args, capture_output=True, timeout=120)
    assert finished.returncode == 0, finished.stderr.decode()
    with RecordStore.open(url, tmp_path, **options) as store:
        stored = list(store.replay("s"))
        assert {r.record_id: r.content_hash for r in stored} == hashes  # every receipt, same hashes
        assert store.get("s", "done").payload == {"score": 0.5} and store.get("s", "waiting").payload["score"] == 0.5
        assert not is_compacted(store.get("s", "r1"))
        assert sum(is_compacted(r) for r in stored) == 49
        assert sum(row["records"] for row in compaction_counts(store)["s"].values()) == 49
