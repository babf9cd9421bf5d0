"""The record store's side of retries and of callers that go away (SQLite and PostgreSQL).

An idempotency key replays only a complete record: an append under a key that names an incomplete record is stored
and the key moves to it, also when two writers race; a key reused for another request is a Conflict. An append
whose caller was cancelled while it queued is stored all the same.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from reef_core.errors import Conflict
from reef_core.observe.records import Record, RecordStore
from reef_core.testing.fixtures import wait_until


@pytest.fixture
def open_store(records_database, tmp_path):
    """``open_store()`` opens a store on the test's database (several may be open at once, as two processes)."""
    url, options = records_database
    opened: list[RecordStore] = []

    def open_one() -> RecordStore:
        opened.append(RecordStore.open(url, tmp_path, **options))
        return opened[-1]

    yield open_one
    for store in opened:
        store.close()


@pytest.fixture
def store(open_store):
    return open_store()


def attempt(record_id: str, complete: bool = True, request_hash: str = "h1", **payload) -> Record:
    return Record(record_id=record_id, scenario="s", kind="inference", complete=complete, request_hash=request_hash,
                  payload={"messages": [{"role": "user", "content": "hi"}], "answer": record_id, **payload})


def test_a_key_naming_an_incomplete_record_moves_to_its_retry(store):
    cut = store.append_sync(attempt("cut", complete=False), idempotency_key="k")
    assert store.find_by_idempotency_key("s", "k") == cut
    again_cut = store.append_sync(attempt("cut-again", complete=False), idempotency_key="k")
    assert again_cut.record_id == "cut-again" and store.find_by_idempotency_key("s", "k") == again_cut
    whole = store.append_sync(attempt("whole"), idempotency_key="k")
    assert whole.record_id == "whole" and store.find_by_idempotency_key("s", "k") == whole
    # Once complete, the key replays that record and stores no other answer ...
    assert store.append_sync(attempt("late"), idempotency_key="k") == whole and store.get("s", "late") is None
    # ... while an incomplete attempt that raced with it is kept beside it, the key unchanged.
    assert store.append_sync(attempt("raced", complete=False), idempotency_key="k").record_id == "raced"
    assert store.find_by_idempotency_key("s", "k") == whole
    assert [r.record_id for r in store.replay("s")] == ["cut", "cut-again", "whole", "raced"]


def test_a_key_reused_for_another_request_conflicts(store):
    store.append_sync(attempt("first", complete=False), idempotency_key="k")
    store.append_sync(attempt("done"), idempotency_key="j")
    for key in ("k", "j"):
        with pytest.raises(Conflict) as info:
            store.append_sync(attempt(f"other-{key}", request_hash="h2"), idempotency_key=key)
        assert info.value.status == 409 and key in info.value.message
    assert store.count("s") == 2


def test_retries_in_one_batch_store_one_complete_answer(store):
    store.append_sync(attempt("cut", complete=False), idempotency_key="k")

    async def both():  # queued together, so the writer takes them in one transaction
        return await asyncio.gather(store.append(attempt("a"), idempotency_key="k"),
                                    store.append(attempt("b"), idempotency_key="k"))

    first, second = asyncio.run(both())
    assert first == second and first.record_id == "a" and store.get("s", "b") is None
    assert store.find_by_idempotency_key("s", "k") == first


def test_racing_writers_agree_on_the_retry_a_key_names(open_store):
    """Two stores on one database (two server processes): concurrent retries of a cut attempt get one answer."""
    stores = [open_store(), open_store()]
    with ThreadPoolExecutor(2) as pool:
        for round_ in range(15):
            key = f"k{round_}"
            stores[0].append_sync(attempt(f"cut{round_}", complete=False), idempotency_key=key)
            barrier = threading.Barrier(2)

            def retry(i: int) -> Record:
                barrier.wait()
                return stores[i].append_sync(attempt(f"r{round_}-{i}"), idempotency_key=key)

            got = list(pool.map(retry, range(2)))
            assert got[0].record_id == got[1].record_id, round_
            assert stores[1].find_by_idempotency_key("s", key).record_id == got[0].record_id
            assert stores[0].count("s") == 2 * (round_ + 1)


def test_an_append_whose_caller_was_cancelled_is_still_stored(store):
    gate = threading.Event()
    held = store._writer.submit_call(lambda conn: gate.wait(30))  # the writer is busy until the gate opens

    async def leave_early():
        task = asyncio.ensure_future(store.append(attempt("gone", complete=False)))
        await asyncio.sleep(0)  # queued behind the held call
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(leave_early())
    gate.set()
    held.result(30)
    wait_until(lambda: store.get("s", "gone") is not None, timeout=30)
