"""Statements the record store runs, built once.

Building a SQLAlchemy statement and its cache key costs more than SQLite takes to run it; the writer runs several
per batch and competes for the GIL with the event loop, so the hot statements are prebuilt with bind parameters
(``expanding`` ones for ``IN`` lists).
"""

from __future__ import annotations

from functools import cache

import sqlalchemy as sa

from reef_core.observe.schema import (consumed_ids, idempotency_keys, record_sequences, records, scenarios,
                                     usage_counters)


def dialect_insert(dialect: str, table: sa.Table):
    """An INSERT construct with ON CONFLICT support for the dialect (``sqlite`` or ``postgresql``). The dialect's
    module is imported when first used: a SQLite deployment never loads the PostgreSQL one."""
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert(table)


RECORD_BY_ID = sa.select(records).where(records.c.scenario == sa.bindparam("scenario"),
                                        records.c.record_id == sa.bindparam("record_id"))
RECORDS_BY_IDS = sa.select(records).where(records.c.scenario == sa.bindparam("scenario"),
                                          records.c.record_id.in_(sa.bindparam("ids", expanding=True)))
REF_INFO_BY_ID = (sa.select(records.c.record_id, records.c.scenario, records.c.kind)
                  .where(records.c.record_id.in_(sa.bindparam("ids", expanding=True))))
#: A scenario's rows among the idempotency keys ``keys``: by both primary-key columns, an index search (by the key
#: alone, the primary key's second column, both backends scanned the whole table).
KEYS_BY_KEY = sa.select(idempotency_keys).where(
    idempotency_keys.c.scenario == sa.bindparam("scenario"),
    idempotency_keys.c.idempotency_key.in_(sa.bindparam("keys", expanding=True)))
INSERT_KEY = sa.insert(idempotency_keys)
#: Point a key at the retry that replaced the incomplete record it named (bind names differ from the columns').
REPOINT_KEY = (sa.update(idempotency_keys)
               .where(idempotency_keys.c.scenario == sa.bindparam("key_scenario"),
                      idempotency_keys.c.idempotency_key == sa.bindparam("key_name"))
               .values(record_id=sa.bindparam("new_record_id")))
KEY_IN_SCENARIO = sa.select(idempotency_keys.c.record_id).where(
    idempotency_keys.c.scenario == sa.bindparam("scenario"),
    idempotency_keys.c.idempotency_key == sa.bindparam("key"))
PAGE = (sa.select(records)
        .where(records.c.scenario == sa.bindparam("scenario"), records.c.sequence > sa.bindparam("after"))
        .order_by(records.c.sequence).limit(sa.bindparam("limit")))
COUNT = sa.select(sa.func.count()).select_from(records).where(records.c.scenario == sa.bindparam("scenario"))
LAST_SEQUENCE = sa.select(sa.func.max(records.c.sequence)).where(records.c.scenario == sa.bindparam("scenario"))
RECENT_BY_REQUEST_HASH = (sa.select(records)
                          .where(records.c.scenario == sa.bindparam("scenario"),
                                 records.c.request_hash == sa.bindparam("request_hash"),
                                 records.c.created_at >= sa.bindparam("since"))
                          .order_by(records.c.sequence.desc()).limit(1))
SCENARIO_BY_NAME = sa.select(scenarios).where(scenarios.c.name == sa.bindparam("name"))
ALL_SCENARIOS = sa.select(scenarios).order_by(scenarios.c.name)
ARCHIVE_SCENARIO = (sa.update(scenarios).where(scenarios.c.name == sa.bindparam("scenario_name"))
                    .values(archived=True))
CONSUMED_IDS = sa.select(consumed_ids.c.record_id).where(consumed_ids.c.scenario == sa.bindparam("scenario"))
IS_CONSUMED = sa.select(consumed_ids.c.step).where(consumed_ids.c.scenario == sa.bindparam("scenario"),
                                                   consumed_ids.c.record_id == sa.bindparam("record_id"))


@cache
def reserve_sequences(dialect: str) -> sa.Insert:
    """Upsert adding ``last_sequence`` (the count to reserve) to a scenario's counter and returning the new last
    sequence (params ``scenario``, ``last_sequence``). The counter row's lock keeps concurrent writers apart."""
    stmt = dialect_insert(dialect, record_sequences)
    return stmt.on_conflict_do_update(
        index_elements=[record_sequences.c.scenario],
        set_={"last_sequence": record_sequences.c.last_sequence + stmt.excluded.last_sequence},
    ).returning(record_sequences.c.last_sequence)


@cache
def keys_by_key(dialect: str) -> sa.Select:
    """A scenario's rows of the given idempotency keys (params ``scenario``, ``keys``). On PostgreSQL the rows are locked until commit: a
    second writer process that wants to repoint the same key waits, then reads where the first one left it."""
    return KEYS_BY_KEY.with_for_update() if dialect == "postgresql" else KEYS_BY_KEY


@cache
def create_scenario(dialect: str) -> sa.Insert:
    """Insert a scenario unless the name exists (params as the table's columns); returns the name when inserted
    (RETURNING rather than rowcount, which drivers need not report for INSERT)."""
    return dialect_insert(dialect, scenarios).on_conflict_do_nothing().returning(scenarios.c.name)


@cache
def mark_consumed(dialect: str) -> sa.Insert:
    """Insert consumed ids, keeping an existing row (its first step) (params as the table's columns); returns the
    ids actually inserted."""
    return dialect_insert(dialect, consumed_ids).on_conflict_do_nothing().returning(consumed_ids.c.record_id)


USAGE_IN_PERIODS = sa.select(usage_counters.c.key, usage_counters.c.period, usage_counters.c.tokens,
                             usage_counters.c.requests).where(
    usage_counters.c.period.in_(sa.bindparam("periods", expanding=True)))


@cache
def add_usage(dialect: str) -> sa.Insert:
    """Add a usage increment to its counter row (params as the table's columns), creating the row when new;
    returns the row's totals. One statement, so concurrent writers (replicas) add up."""
    insert = dialect_insert(dialect, usage_counters)
    return insert.on_conflict_do_update(
        index_elements=[usage_counters.c.key, usage_counters.c.period],
        set_={"tokens": usage_counters.c.tokens + insert.excluded.tokens,
              "requests": usage_counters.c.requests + insert.excluded.requests,
              "updated_at": insert.excluded.updated_at},
    ).returning(usage_counters.c.tokens, usage_counters.c.requests)
