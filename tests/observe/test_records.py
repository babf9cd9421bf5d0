"""Behaviour of the record store (reef_core.observe.records) on SQLite and PostgreSQL.

PostgreSQL runs use a fresh schema per test (``schema=`` option), dropped afterwards, so parallel or old runs
never see each other's rows.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import sqlalchemy as sa

from reef_core.errors import Conflict, NotFound, StorageUnavailable, ValidationFailed
from reef_core.observe.records import Record, RecordStore
from reef_core.testing.fixtures import wait_until

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@dataclass
class Backend:
    name: str
    url: str | None
    data_dir: Path
    opts: dict = field(default_factory=dict)

    def open(self, **extra) -> RecordStore:
        return RecordStore.open(self.url, self.data_dir, **{**self.opts, **extra})


@pytest.fixture
def backend(records_database, tmp_path):
    url, opts = records_database
    return Backend("sqlite" if url is None else "postgres", url, tmp_path, opts)


@pytest.fixture
def store(backend):
    opened = backend.open()
    yield opened
    opened.close()


def inference(record_id: str, scenario: str = "s", **fields) -> Record:
    payload = fields.pop("payload", {"messages": [{"role": "user", "content": f"hi {record_id}"}]})
    return Record(record_id=record_id, scenario=scenario, kind="inference", payload=payload, **fields)


def report(record_id: str, references: list[str], scenario: str = "s", score: float = 1.0) -> Record:
    return Record(record_id=record_id, scenario=scenario, kind="report", payload={"score": score},
                  references=references)


# -- the Record type -----------------------------------------------------------------------------------------------


def test_record_validates_fields_and_hashes_content_canonically():
    a = Record(record_id="r", scenario="s", kind="inference", payload={"a": 1, "b": [1, 2]})
    b = Record(record_id="r", scenario="s", kind="inference", payload={"b": [1, 2], "a": 1}, tags={"x": "y"})
    assert a.content_hash == b.content_hash  # key order and tags do not change the content
    assert a.content_hash != Record(record_id="r", scenario="t", kind="inference", payload={"a": 1, "b": [1, 2]}
                                    ).content_hash
    assert a.content_hash != Record(record_id="r", scenario="s", kind="report", payload={"a": 1, "b": [1, 2]}
                                    ).content_hash
    with pytest.raises(ValidationFailed):
        Record(record_id="r", scenario="s", kind="bogus", payload={})
    with pytest.raises(ValidationFailed):
        Record(record_id="", scenario="s", kind="inference", payload={})
    with pytest.raises(ValidationFailed):
        Record(record_id="r", scenario="s", kind="inference", payload={"x": float("nan")})
    with pytest.raises(ValidationFailed):
        Record(record_id="r", scenario="s", kind="inference", payload={"x": {1, 2}})
    with pytest.raises(ValidationFailed):
        Record(record_id="r", scenario="s", kind="report", payload={}, references=[1])
    with pytest.raises(ValidationFailed):
        Record(record_id="r", scenario="s", kind="inference", payload={}, version=3)
    with pytest.raises(ValidationFailed):
        Record(record_id="r", scenario="s", kind="inference", payload={}, tags={"t": object()})


# -- appends -------------------------------------------------------------------------------------------------------


def test_append_round_trips_every_field_and_numbers_per_scenario(store):
    first = inference("a1", tags={"session": "x"}, version="rel-3", complete=False, request_hash="h1",
                      payload={"messages": [{"role": "user", "content": "héllo ✓"}], "n": 1.5, "z": None})
    stored = asyncio.run(store.append(first))
    assert stored.sequence == 1
    assert store.get("s", "a1") == stored
    assert stored.payload == first.payload and stored.tags == {"session": "x"} and stored.version == "rel-3"
    assert stored.complete is False and stored.request_hash == "h1" and stored.content_hash == first.content_hash
    assert stored.created_at == pytest.approx(first.created_at)

    assert store.append_sync(inference("a2")).sequence == 2
    assert store.append_sync(inference("b1", scenario="other")).sequence == 1  # sequences are per scenario
    assert store.get("s", "missing") is None
    assert store.count("s") == 2 and store.count("other") == 1 and store.count("nobody") == 0
    many = store.get_many("s", ["a2", "missing", "a1"])  # one query, the order asked, None for an unknown id
    assert [r.record_id if r else None for r in many] == ["a2", None, "a1"] and many[2] == stored
    assert store.get_many("s", []) == []
    assert store.get("s", "b1") is None and store.get_many("other", ["b1", "a1"])[1] is None  # ids are per scenario


def test_same_id_same_content_returns_the_stored_record(store):
    original = store.append_sync(inference("r1"))
    store.append_sync(inference("r2"))
    again = store.append_sync(inference("r1", tags={"retry": "1"}, created_at=time.time() + 5))
    assert again == original  # sequence, tags and created_at of the first write
    assert store.count("s") == 2


def test_same_id_different_content_conflicts(store):
    store.append_sync(inference("r1", payload={"v": 1}))
    with pytest.raises(Conflict) as info:
        store.append_sync(inference("r1", payload={"v": 2}))
    assert info.value.status == 409
    # ids are scoped per scenario: the same id in another scenario is another record (#37 D5)
    elsewhere = store.append_sync(inference("r1", scenario="t", payload={"v": 3}))
    assert (elsewhere.scenario, elsewhere.sequence) == ("t", 1)
    assert store.get("s", "r1").payload == {"v": 1} and store.get("t", "r1").payload == {"v": 3}


def test_idempotency_key_maps_to_the_first_record(store):
    first = asyncio.run(store.append(inference("k1"), idempotency_key="retry-7"))
    second = asyncio.run(store.append(inference("k2", payload={"other": True}), idempotency_key="retry-7"))
    assert second == first and store.get("s", "k2") is None and store.count("s") == 1
    # keys are scoped per scenario
    elsewhere = store.append_sync(inference("k3", scenario="t"), idempotency_key="retry-7")
    assert elsewhere.record_id == "k3"
    # an id already stored under no key gets the key attached
    store.append_sync(inference("k4"))
    assert store.append_sync(inference("k4"), idempotency_key="late").record_id == "k4"
    assert store.append_sync(inference("k5"), idempotency_key="late").record_id == "k4"
    assert store.count("s") == 2


def test_append_many_is_all_or_nothing(store):
    store.append_sync(inference("x1", payload={"v": 1}))
    batch = [inference("m1"), inference("m2"), inference("x1", payload={"v": 2})]  # the last conflicts
    with pytest.raises(Conflict):
        asyncio.run(store.append_many(batch))
    assert store.get("s", "m1") is None and store.get("s", "m2") is None

    bad_refs = [inference("m1"), report("m2", ["m1", "nope"])]
    with pytest.raises(ValidationFailed, match="nope"):
        store.append_many_sync(bad_refs, check_references=True)
    assert store.get("s", "m1") is None

    stored = asyncio.run(store.append_many(
        [inference("m1"), report("m2", ["m1", "x1"]), inference("x1", payload={"v": 1})], check_references=True))
    assert [r.record_id for r in stored] == ["m1", "m2", "x1"]
    assert [r.sequence for r in stored] == [2, 3, 1]  # x1 was already stored: its own sequence comes back
    assert asyncio.run(store.append_many([])) == []
    assert store.count("s") == 3


def test_check_references_names_the_first_bad_reference(store):
    store.append_many_sync([inference("i1"), inference("i2"), inference("t1", scenario="t")])
    store.append_sync(report("rep", ["i1"]))
    store.check_references("s", ["i1", "i2"])
    store.check_references("s", [])
    cases = {
        "unknown": (["i1", "ghost", "t1"], "ghost"),
        "other scenario": (["i1", "t1", "ghost"], "t1"),
        "not inference": (["rep"], "rep"),
        "duplicate": (["i2", "i1", "i2"], "i2"),
    }
    for why, (ids, bad) in cases.items():
        with pytest.raises(ValidationFailed) as info:
            store.check_references("s", ids)
        assert info.value.details["reference"] == bad, why
        assert repr(bad) in info.value.message
    with pytest.raises(ValidationFailed):
        store.check_references("s", "i1")


def test_append_can_check_a_reports_references_in_its_transaction(store):
    store.append_sync(inference("i1"))
    with pytest.raises(ValidationFailed, match="'i9'"):
        asyncio.run(store.append(report("r1", ["i1", "i9"]), check_references=True))
    assert store.get("s", "r1") is None
    assert store.append_sync(report("r1", ["i1"]), check_references=True).sequence == 2


def test_an_unstorable_record_fails_alone(store):
    # A precomputed content hash skips the Record's own JSON check; the writer must still refuse only that record.
    bad = Record(record_id="bad", scenario="s", kind="inference", payload={"x": {1, 2}}, content_hash="0" * 64)

    async def main():
        return await asyncio.gather(store.append(inference("ok1")), store.append(bad), store.append(inference("ok2")),
                                    return_exceptions=True)

    ok1, failed, ok2 = asyncio.run(main())
    assert isinstance(failed, ValidationFailed)
    assert ok1.sequence == 1 and ok2.sequence == 2 and store.get("s", "bad") is None


def test_a_precomputed_hash_record_with_nan_is_refused_not_stored_as_null(store):
    # The fast storage encoder writes NaN as null; only payloads the Record checked itself may take it.
    bad = Record(record_id="nan", scenario="s", kind="inference", payload={"x": float("nan")}, content_hash="0" * 64)
    with pytest.raises(ValidationFailed, match="not storable as JSON"):
        store.append_sync(bad)
    assert store.get("s", "nan") is None


def test_payload_values_round_trip_through_the_stored_json(store):
    # Characters COPY and JSON escape, numbers whose spelling differs between encoders, integer keys (stored as
    # strings, as the standard encoder does) and integers beyond 64 bits (the fast encoder refuses them).
    text = 'tab\there "quoted" back\\slash\nnew line \u0000 nul é 中 🐟'
    payload = {"text": text, "floats": [1e-07, -1.25e-05, 1e16, 0.1, 1.5], "ints": [0, -3, 2**63 - 1],
               "nested": {"b": [True, False, None], "a": {}}}
    stored = store.append_sync(Record(record_id="rt", scenario="s", kind="inference", payload=payload,
                                      references=[], tags={"k": text}, top_k=b"\x00\\\n\t\xff"))
    big = store.append_sync(Record(record_id="big", scenario="s", kind="inference",
                                   payload={"n": 2**70, "keys": {1: "int key"}}))
    got = store.get("s", "rt")
    assert got.payload == payload and list(got.payload) == list(payload)  # values and key order kept
    assert got.tags == {"k": text} and got.top_k == b"\x00\\\n\t\xff"
    assert got.content_hash == stored.content_hash
    assert store.get("s", "big").payload == {"n": 2**70, "keys": {"1": "int key"}} and big.sequence == 2


def test_concurrent_appends_keep_per_scenario_order_and_share_transactions(store):
    async def main():
        return await asyncio.gather(*[
            store.append(inference(f"c{i}", scenario=("a" if i % 3 else "b"))) for i in range(200)])

    before = store.stats
    stored = asyncio.run(main())
    after = store.stats
    for scenario in ("a", "b"):
        mine = [r for r in stored if r.scenario == scenario]
        assert sorted(r.sequence for r in mine) == list(range(1, len(mine) + 1))
        # submission order is commit order: sequences follow the order the appends were issued
        assert [r.sequence for r in mine] == sorted(r.sequence for r in mine)
        listed = [r.record_id for r in store.replay(scenario)]
        assert listed == [r.record_id for r in mine]
    assert after.rows - before.rows == 200
    assert after.transactions - before.transactions < 200  # group commit: fewer transactions than rows
    assert after.largest_batch > 1


def test_appends_from_several_event_loops_and_threads(store):
    def loop_worker(tag: str) -> list[Record]:
        async def main():
            return await asyncio.gather(*[store.append(inference(f"{tag}-{i}")) for i in range(25)])
        return asyncio.run(main())

    def thread_worker(tag: str) -> list[Record]:
        return [store.append_sync(inference(f"{tag}-{i}")) for i in range(10)]

    with ThreadPoolExecutor(max_workers=4) as pool:
        jobs = [pool.submit(loop_worker, "L1"), pool.submit(loop_worker, "L2"),
                pool.submit(thread_worker, "T1"), pool.submit(thread_worker, "T2")]
        stored = [r for job in jobs for r in job.result()]
    assert len(stored) == 70 and store.count("s") == 70
    assert sorted(r.sequence for r in stored) == list(range(1, 71))


def test_failed_batch_is_retried_one_by_one(backend, store):
    """A row the database rejects fails only its own caller; the rest of its batch is stored."""
    if backend.name == "sqlite":
        db = sqlite3.connect(backend.data_dir / "records.db", timeout=30, isolation_level=None)
        db.execute("CREATE TRIGGER poison BEFORE INSERT ON records WHEN NEW.record_id LIKE 'poison%' "
                   "BEGIN SELECT RAISE(ABORT, 'poisoned row'); END")
        lock = lambda: db.execute("BEGIN IMMEDIATE")  # noqa: E731
        unlock = lambda: db.execute("COMMIT")  # noqa: E731
    else:
        schema = backend.opts["schema"]
        engine = sa.create_engine(PG_URL)
        with engine.begin() as conn:
            conn.exec_driver_sql(
                f'CREATE FUNCTION "{schema}".poison() RETURNS trigger AS $$ BEGIN '
                f"IF NEW.record_id LIKE 'poison%%' THEN RAISE EXCEPTION 'poisoned row'; END IF; RETURN NEW; "
                f"END $$ LANGUAGE plpgsql")
            conn.exec_driver_sql(f'CREATE TRIGGER poison BEFORE INSERT ON "{schema}".records '
                                 f'FOR EACH ROW EXECUTE FUNCTION "{schema}".poison()')
        holder = engine.connect()
        lock = lambda: holder.exec_driver_sql(f'LOCK TABLE "{schema}".records IN SHARE MODE')  # noqa: E731
        unlock = lambda: holder.commit()  # noqa: E731

    async def main():
        lock()  # the writer blocks on its first batch, so everything after it queues into one batch
        blocker = asyncio.ensure_future(store.append(inference("blocker")))
        await asyncio.sleep(0)
        await asyncio.to_thread(wait_until, lambda: store.stats.batches == 1)
        names = [f"good{i}" for i in range(10)] + ["poison1"] + [f"good{i}" for i in range(10, 20)]
        tasks = [asyncio.ensure_future(store.append(inference(name))) for name in names]
        await asyncio.sleep(0)
        await asyncio.to_thread(wait_until, lambda: store.stats.pending == len(names))
        unlock()
        await blocker
        return names, await asyncio.gather(*tasks, return_exceptions=True)

    names, outcomes = asyncio.run(main())
    results = dict(zip(names, outcomes))
    assert isinstance(results.pop("poison1"), StorageUnavailable)
    assert all(isinstance(r, Record) for r in results.values())
    assert store.get("s", "poison1") is None
    assert {r.record_id for r in store.replay("s")} == set(results) | {"blocker"}
    stats = store.stats
    assert stats.retried_batches == 1 and stats.failed_requests == 1
    if backend.name == "postgres":
        holder.close()
        engine.dispose()
    else:
        db.close()


def test_a_full_write_queue_fails_fast(tmp_path):
    store = RecordStore.open(None, tmp_path, max_pending=1)
    db = sqlite3.connect(tmp_path / "records.db", timeout=30, isolation_level=None)
    db.execute("BEGIN IMMEDIATE")  # the writer stalls on its first batch
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            first = pool.submit(store.append_sync, inference("first"))
            wait_until(lambda: store.stats.batches == 1, timeout=15, interval=0.002)
            second = pool.submit(store.append_sync, inference("second"))
            wait_until(lambda: store.stats.pending == 1, timeout=15, interval=0.002)
            with pytest.raises(StorageUnavailable, match="queue full"):
                store.append_sync(inference("third"))
            db.execute("COMMIT")
            assert first.result().sequence == 1 and second.result().sequence == 2
    finally:
        if db.in_transaction:
            db.execute("COMMIT")
        db.close()
        store.close()


def test_close_commits_queued_appends_then_refuses(backend):
    store = backend.open()

    async def main():
        tasks = [asyncio.ensure_future(store.append(inference(f"q{i}"))) for i in range(40)]
        await asyncio.sleep(0)  # every task has queued its append
        closer = asyncio.get_running_loop().run_in_executor(None, store.close)
        stored = await asyncio.gather(*tasks)
        await closer
        return stored

    stored = asyncio.run(main())
    assert len({r.sequence for r in stored}) == 40
    with pytest.raises(StorageUnavailable):
        store.append_sync(inference("late"))
    with pytest.raises(StorageUnavailable):
        store.get("s", "q1")
    store.close()  # idempotent
    with backend.open() as reopened:
        assert reopened.count("s") == 40


# -- reads ---------------------------------------------------------------------------------------------------------


def test_page_and_replay_in_sequence_order(store):
    store.append_many_sync([inference(f"p{i:04d}") for i in range(1203)])
    store.append_sync(inference("elsewhere", scenario="t"))
    first = store.page("s")
    assert [r.sequence for r in first] == list(range(1, 51))
    assert [r.sequence for r in store.page("s", after_sequence=1190, limit=100)] == list(range(1191, 1204))
    assert store.page("s", after_sequence=1203) == []
    for bad in ({"limit": 0}, {"limit": 101}, {"after_sequence": -1}, {"limit": True}):
        with pytest.raises(ValidationFailed):
            store.page("s", **bad)
    replayed = list(store.replay("s"))
    assert [r.sequence for r in replayed] == list(range(1, 1204))  # crosses several internal pages
    assert [r.record_id for r in store.replay("s", after_sequence=1200)] == ["p1200", "p1201", "p1202"]
    assert store.count("s") == 1203


def test_find_recent_by_request_hash(store):
    now = time.time()
    store.append_sync(inference("old", request_hash="h", created_at=now - 1000))
    assert store.find_recent_by_request_hash("s", "h") is None  # older than the default 600 s
    assert store.find_recent_by_request_hash("s", "h", within_s=2000).record_id == "old"
    store.append_sync(inference("new1", request_hash="h"))
    store.append_sync(inference("new2", request_hash="h"))
    store.append_sync(inference("other", request_hash="h2"))
    store.append_sync(inference("foreign", scenario="t", request_hash="h"))
    assert store.find_recent_by_request_hash("s", "h").record_id == "new2"
    assert store.find_recent_by_request_hash("s", "nope") is None


# -- scenarios and consumed ids ------------------------------------------------------------------------------------


def test_scenarios_bind_once_to_a_recipe(store):
    created, was_created = store.get_or_create_scenario("alpha", "sao")
    assert was_created and created.name == "alpha" and created.recipe == "sao" and not created.archived
    again, was_created = store.get_or_create_scenario("alpha", "sao")
    assert not was_created and again == created
    with pytest.raises(Conflict):
        store.get_or_create_scenario("alpha", "cordis")
    store.get_or_create_scenario("beta", "sao")
    assert [s.name for s in store.scenarios()] == ["alpha", "beta"]
    archived = store.archive_scenario("alpha")
    assert archived.archived and store.get_scenario("alpha").archived
    assert store.get_or_create_scenario("alpha", "sao") == (archived, False)
    with pytest.raises(NotFound):
        store.archive_scenario("ghost")
    assert store.get_scenario("ghost") is None


def test_concurrent_scenario_creation_creates_once(backend, store):
    other = backend.open()  # a second store on the same database: another writer, as another process would be
    try:
        barrier = threading.Barrier(8)

        def create(i: int):
            barrier.wait()
            return (store if i % 2 else other).get_or_create_scenario("gamma", "sao")

        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(create, range(8)))
    finally:
        other.close()
    assert sum(created for _, created in results) == 1
    assert len({scenario for scenario, _ in results}) == 1


def test_consumed_ids_keep_their_first_step(store):
    assert store.mark_consumed("s", ["a", "b", "a"], step=1) == 2
    assert store.mark_consumed("s", ["b", "c"], step=2) == 1
    assert store.mark_consumed("s", [], step=3) == 0
    assert store.consumed_ids("s") == {"a", "b", "c"}
    assert store.consumed_ids("t") == set()
    assert store.is_consumed("s", "b") and not store.is_consumed("t", "b") and not store.is_consumed("s", "z")
    with pytest.raises(ValidationFailed):
        store.mark_consumed("s", ["x"], step=-1)


def test_find_by_idempotency_key_is_per_scenario(tmp_path):
    import asyncio

    from reef_core.observe.records import Record, RecordStore

    with RecordStore.open(None, tmp_path) as store:
        stored = asyncio.run(store.append(Record(record_id="r1", scenario="a", kind="inference", payload={"x": 1}),
                                          idempotency_key="key-1"))
        assert store.find_by_idempotency_key("a", "key-1") == stored
        assert store.find_by_idempotency_key("b", "key-1") is None
        assert store.find_by_idempotency_key("a", "key-2") is None


def test_an_append_creates_its_scenario_only_when_accepted(store):
    # A refused append (a bad reference, a conflicting group) creates nothing; an accepted one creates the scenario,
    # bound to the recipe given, in its own transaction.
    with pytest.raises(Conflict):
        asyncio.run(store.append_many([inference("r1", scenario="new"), inference("r1", scenario="new", payload={})],
                                      new_scenario_recipe="gepa"))
    with pytest.raises(ValidationFailed):
        asyncio.run(store.append(report("rep", ["missing"], scenario="new"), check_references=True,
                                 new_scenario_recipe="gepa"))
    assert store.get_scenario("new") is None
    asyncio.run(store.append(inference("r2", scenario="new"), new_scenario_recipe="gepa"))
    assert store.get_scenario("new").recipe == "gepa"
    asyncio.run(store.append(inference("r3", scenario="new"), new_scenario_recipe="sao"))  # an existing binding stays
    assert store.get_scenario("new").recipe == "gepa"
