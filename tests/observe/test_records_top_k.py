"""Top-K log-probs in the record store: a binary column, compact, absent when K=0, old rows still read."""

from __future__ import annotations

import json
import random

import pytest

from reef_core.engines.base import TokenData
from reef_core.topk import TopK
from reef_core.observe.engine import create_engines, current_revision, migrate, resolve_url
from reef_core.observe.processors.conversation import tokens_of
from reef_core.observe.records import Record, RecordStore

VOCAB = 151_936  # a large (Qwen-sized) vocabulary: ids need more than 16 bits


@pytest.fixture
def target(records_database, tmp_path):
    """(url, data_dir, open options) of an empty store location (SQLite, or a PostgreSQL schema of its own)."""
    url, options = records_database
    return url, tmp_path, options


def _generation(n_out: int, k: int, seed: int = 0) -> TokenData:
    """Token data shaped like a real generation: random ids over VOCAB, sorted random top-K log-probs."""
    rnd = random.Random(seed)
    ids, lps = [], []
    for _ in range(n_out):
        ids += rnd.sample(range(VOCAB), k)
        lps += sorted((-rnd.random() * 25 for _ in range(k)), reverse=True)
    top = TopK(k=k, ids=ids, logprobs=lps) if k else None
    output = [top.row(t)[0][0] if top else rnd.randrange(VOCAB) for t in range(n_out)]
    own = [top.row(t)[1][0] if top else -rnd.random() * 5 for t in range(n_out)]
    return TokenData([rnd.randrange(VOCAB) for _ in range(120)], output, own, "v1:3", top)


def _record(record_id: str, tokens: TokenData) -> Record:
    """An inference record as the server writes it (see reef_core.serve.routes.inference)."""
    reply = " ".join(f"word{i}" for i in range(len(tokens.output_ids)))
    payload = {"route": "chat", "dialect": "openai", "client_dialect": "openai", "engine": "smollm2",
               "request": {"model": "smollm2", "messages": [{"role": "user", "content": "Write a long story."}]},
               "response": {"id": "chatcmpl-1", "object": "chat.completion", "model": "smollm2",
                            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                                         "finish_reason": "length"}]},
               "stream": False, "timings": {"engine_ms": 1.0, "total_ms": 2.0}, "tokens": tokens.to_dict()}
    return Record(record_id=record_id, scenario="s", kind="inference", payload=payload, version=tokens.version,
                  top_k=tokens.packed_top_k())


def _stored_bytes(store: RecordStore, record_id: str) -> tuple[int, int | None]:
    """(bytes of the whole stored row's columns as the database holds them, bytes of its top_k column)."""
    engines = store._engines
    if engines.dialect == "sqlite":
        cols = "+".join(f'coalesce(length(CAST("{c}" AS BLOB)), 0)' for c in
                        ("record_id", "scenario", "kind", "version", "request_hash", "content_hash", "references",
                         "tags", "payload", "top_k"))
        sql = f"SELECT {cols} + 8 * 4, length(top_k) FROM records WHERE record_id = ?"
        params = (record_id,)
    else:
        # Row size before TOAST compression: the bound must hold without the database's help.
        cols = "+".join(f'coalesce(octet_length("{c}"::text), 0)' for c in
                        ("record_id", "scenario", "kind", "version", "request_hash", "content_hash", "references",
                         "tags", "payload"))
        sql = (f'SELECT {cols} + coalesce(octet_length(top_k), 0) + 8 * 4, octet_length(top_k) '
               f'FROM "{engines.schema}".records WHERE record_id = %s')
        params = (record_id,)
    with engines.raw[0].connect() as conn:
        return tuple(conn.exec_driver_sql(sql, params).one())


def test_a_512_token_reply_with_k20_stays_under_64_kib(target):
    url, data_dir, opts = target
    tokens = _generation(512, 20)
    with RecordStore.open(url, data_dir, **opts) as store:
        store.append_sync(_record("big", tokens))
        total, top_bytes = _stored_bytes(store, "big")
        assert total < 64 * 1024, total
        assert top_bytes < 44 * 1024
        back = store.get("s", "big")
    restored = TopK.unpack(back.top_k)
    assert restored.ids == tokens.top_k.ids
    assert restored.logprobs == pytest.approx(tokens.top_k.logprobs, rel=2 ** -11)
    read = tokens_of(back)  # what processors hand to the trainer
    assert read["top_k"].ids == tokens.top_k.ids and read["output_ids"] == tokens.output_ids


def test_k0_stores_nothing_extra(target):
    url, data_dir, opts = target
    tokens = _generation(64, 0)
    with RecordStore.open(url, data_dir, **opts) as store:
        stored = store.append_sync(_record("plain", tokens))
        assert stored.top_k is None
        total, top_bytes = _stored_bytes(store, "plain")
        assert top_bytes is None
        back = store.get("s", "plain")
    assert back.top_k is None and back.payload["tokens"] == tokens.to_dict()
    assert "top_k" not in tokens_of(back)


def test_records_written_before_the_top_k_column_still_read(target):
    url, data_dir, opts = target
    engines = create_engines(resolve_url(url, data_dir), schema=opts.get("schema"))
    try:
        migrate(engines, "0001")  # the store as it was before top-K
        assert current_revision(engines) == "0001"
        # A row as revision 0001's writer stored it (no top_k column), inserted by hand.
        old_tokens = _generation(8, 0).to_dict()
        record = Record(record_id="old", scenario="before", kind="inference", payload={"tokens": old_tokens})
        table = f'"{engines.schema}".records' if engines.schema else "records"
        mark = "%s" if engines.dialect == "postgresql" else "?"
        with engines.raw[0].begin() as conn:
            conn.exec_driver_sql(
                f'INSERT INTO {table} (record_id, scenario, kind, sequence, created_at, version, complete, '
                f'request_hash, content_hash, "references", tags, payload) VALUES ({", ".join([mark] * 12)})',
                (record.record_id, record.scenario, "inference", 1, record.created_at, None, True, None,
                 record.content_hash, "[]", "{}", json.dumps(record.payload)))
    finally:
        engines.dispose()
    with RecordStore.open(url, data_dir, **opts) as store:  # migrates 0001 -> head
        assert current_revision(store._engines) != "0001"
        back = store.get("before", "old")
        assert back is not None and back.top_k is None and back.payload["tokens"] == old_tokens
        assert back.content_hash == record.content_hash
        assert store.append_sync(_record("new", _generation(4, 3))).top_k is not None
        assert TopK.unpack(store.get("s", "new").top_k).k == 3
