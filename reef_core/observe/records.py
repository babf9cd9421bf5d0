"""The durable record store: every interaction and report, in order, per scenario.

Usage::

    store = RecordStore.open(None, data_dir)                  # SQLite at <data_dir>/records.db (WAL, synchronous=FULL)
    store = RecordStore.open("postgresql+psycopg://postgres@127.0.0.1:5432/test", data_dir, schema="reef_records")
    stored = await store.append(Record(record_id=..., scenario="s", kind="inference", payload={...}))

``append`` returns only after the row is committed durably. Writes from all callers funnel into one writer thread
that commits them in batches (group commit, :mod:`reef_core.observe.writer`), so concurrent callers share fsyncs.
Reads run directly on a connection pool and see every write whose ``append`` has returned.

Options of :meth:`RecordStore.open`:

* ``schema`` (PostgreSQL only, default ``reef_records``): the PostgreSQL schema holding the store's tables and its
  Alembic version table (``reef_records_alembic_version``). Created if missing. Give each deployment or test run its
  own schema to keep their data apart.
* ``synchronous`` (SQLite only, default ``FULL``): ``FULL``/``EXTRA`` are durable; ``NORMAL`` may lose the last
  commits on power loss.
* ``batch_size`` (default 500): most rows committed in one transaction.
* ``max_pending`` (default 10,000): queued requests beyond which ``append`` fails fast with ``StorageUnavailable``.
* ``linger_s`` (default 0.002): under load, how long the writer may wait for the callers it just answered to send
  their next request, so they share the next transaction (0 disables; a lone caller never waits).

Sync methods (``get``, ``page``, scenario and consumed-id calls, ``append_sync``) block the calling thread; from an
event loop against PostgreSQL, prefer running them in a worker thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import sqlalchemy as sa

from reef_core.errors import ConfigError, Conflict, NotFound, StorageUnavailable, ValidationFailed
from reef_core.observe import queries as q
from reef_core.observe.batch import AppendRequest, fetch_ref_info, row_to_record, validate_references
from reef_core.observe.engine import Engines, create_engines, ensure_schema, resolve_url
from reef_core.observe.model import Record, Scenario, check_identifier
from reef_core.observe.writer import Writer, WriterStats

__all__ = ["Record", "RecordStore", "Scenario", "WriterStats"]

MAX_PAGE = 100
_REPLAY_PAGE = 500


class RecordStore:
    """Durable, ordered store of records, scenarios, idempotency keys and consumed ids (see the module docstring)."""

    def __init__(self, engines: Engines, *, batch_size: int = 500, max_pending: int = 10_000,
                 linger_s: float = 0.002):
        """Use :meth:`open`; this wraps engines whose schema is already migrated."""
        self._engines = engines
        self._writer = Writer(engines.writer, engines.dialect, batch_size=batch_size, max_pending=max_pending,
                              linger_s=linger_s)
        self._closed = False

    @classmethod
    def open(cls, url: str | None = None, data_dir: Path | str = ".reef", *, schema: str | None = None,
             synchronous: str = "FULL", batch_size: int = 500, max_pending: int = 10_000,
             linger_s: float = 0.002) -> RecordStore:
        """Open (creating and migrating as needed) the store at ``url``, or SQLite in ``data_dir`` when ``None``.

        Raises :class:`ConfigError` for a bad URL or option, :class:`StorageUnavailable` when the database cannot
        be reached.
        """
        if batch_size < 1 or max_pending < 1 or linger_s < 0:
            raise ConfigError("batch_size and max_pending must be positive and linger_s not negative")
        engines = create_engines(resolve_url(url, Path(data_dir)), schema=schema, synchronous=synchronous)
        try:
            ensure_schema(engines)
        except BaseException:
            engines.dispose()
            raise
        return cls(engines, batch_size=batch_size, max_pending=max_pending, linger_s=linger_s)

    @property
    def dialect(self) -> str:
        """``sqlite`` or ``postgresql``."""
        return self._engines.dialect

    @property
    def schema(self) -> str | None:
        """The PostgreSQL schema of this store (``None`` on SQLite)."""
        return self._engines.schema

    @property
    def sql_engine(self) -> sa.Engine:
        """The store's schema-mapped SQLAlchemy engine, for tables kept beside the records in the same database
        (the PostgreSQL commit log, learner leases); reads and short transactions only, never record writes."""
        return self._engines.reader

    @property
    def stats(self) -> WriterStats:
        """A snapshot of the writer's counters (transactions, rows, batches, ...)."""
        return self._writer.stats()

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Commit everything queued, stop the writer and release connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        self._engines.dispose()

    def __enter__(self) -> RecordStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- appends ------------------------------------------------------------------------------------------------

    async def append(self, record: Record, idempotency_key: str | None = None, *,
                     check_references: bool = False, new_scenario_recipe: str | None = None) -> Record:
        """Store ``record`` durably and return it with its sequence.

        An id already stored with the same content returns the stored record; with other content it raises
        :class:`Conflict`. With ``idempotency_key``: a key unused in the scenario is attached to the record; a key
        naming a complete record returns that record and stores nothing when ``record`` is complete too (an
        incomplete one is stored, the key unchanged); a key naming an incomplete record stores ``record`` and
        moves the key to it (a retry replaces a cut attempt). A key whose record has another ``request_hash``
        raises :class:`Conflict`. ``check_references`` validates a report's references in the same transaction.
        ``new_scenario_recipe`` creates the record's scenario, bound to that recipe, in the same transaction when
        it does not exist yet; a refused append creates nothing. Cancelling the caller does not withdraw the
        append (see :meth:`submit`).
        """
        return (await self.submit(record, idempotency_key, check_references=check_references,
                                  new_scenario_recipe=new_scenario_recipe))[0]

    def submit(self, record: Record, idempotency_key: str | None = None, *,
               check_references: bool = False, new_scenario_recipe: str | None = None) -> asyncio.Future:
        """Queue :meth:`append`'s write now and return a future of the running loop resolving to
        ``[stored record]`` once it is durable (or to its error). The write stands whatever happens to the future's
        waiters: a caller cancelled while it waits (a client gone) still gets its record stored."""
        request = self._request([record], idempotency_key, check_references)
        if new_scenario_recipe is not None:
            request.new_scenario_recipe = check_identifier("recipe", new_scenario_recipe)
        return self._writer.submit_append(request, asyncio.get_running_loop())

    def append_sync(self, record: Record, idempotency_key: str | None = None, *,
                    check_references: bool = False) -> Record:
        """Blocking :meth:`append`, for threads without an event loop."""
        return self._writer.submit_append(self._request([record], idempotency_key, check_references)).result()[0]

    async def append_many(self, items: Sequence[Record], *, check_references: bool = False,
                          new_scenario_recipe: str | None = None) -> list[Record]:
        """Store all of ``items`` in one transaction, or none of them (a :class:`Conflict` or a reference error in
        any one refuses all). Reports may reference inference records earlier in ``items``. Identical records
        already stored are returned as stored. ``new_scenario_recipe`` as in :meth:`append` (all ``items`` must
        then be of one scenario)."""
        return await self.submit_many(items, check_references=check_references,
                                      new_scenario_recipe=new_scenario_recipe)

    def submit_many(self, items: Sequence[Record], *, check_references: bool = False,
                    new_scenario_recipe: str | None = None) -> asyncio.Future:
        """Queue :meth:`append_many`'s write now; a future of the running loop resolving to the stored records."""
        request = self._request(list(items), None, check_references)
        if new_scenario_recipe is not None:
            if len({r.scenario for r in request.records}) > 1:
                raise ValidationFailed("records created with their scenario must all be of that scenario")
            request.new_scenario_recipe = check_identifier("recipe", new_scenario_recipe)
        loop = asyncio.get_running_loop()
        if not request.records:
            done = loop.create_future()
            done.set_result([])
            return done
        return self._writer.submit_append(request, loop)

    def append_many_sync(self, items: Sequence[Record], *, check_references: bool = False) -> list[Record]:
        """Blocking :meth:`append_many`."""
        if not items:
            return []
        return self._writer.submit_append(self._request(list(items), None, check_references)).result()

    def _request(self, items: list[Record], key: str | None, check_references: bool) -> AppendRequest:
        self._check_open()
        for item in items:
            if not isinstance(item, Record):
                raise ValidationFailed(f"expected a Record, got {type(item).__name__}")
        if key is not None:
            check_identifier("idempotency_key", key)
        return AppendRequest(records=items, idempotency_key=key, check_references=check_references)

    # -- record reads -------------------------------------------------------------------------------------------

    def get(self, scenario: str, record_id: str) -> Record | None:
        """``scenario``'s record with this id, or ``None`` (ids are scoped per scenario)."""
        with self._read() as conn:
            row = conn.execute(q.RECORD_BY_ID, {"scenario": scenario, "record_id": record_id}).first()
        return row_to_record(row) if row is not None else None

    def get_many(self, scenario: str, record_ids: Sequence[str]) -> list[Record | None]:
        """``scenario``'s records with these ids, in the order asked (``None`` for an unknown id), in one query."""
        ids = list(record_ids)
        if not ids:
            return []
        with self._read() as conn:
            found = {row.record_id: row_to_record(row)
                     for row in conn.execute(q.RECORDS_BY_IDS, {"scenario": scenario, "ids": ids})}
        return [found.get(i) for i in ids]

    def page(self, scenario: str, after_sequence: int = 0, limit: int = 50) -> list[Record]:
        """Up to ``limit`` (1..100) records of ``scenario`` with sequence above ``after_sequence``, oldest first."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
            raise ValidationFailed(f"limit must be an integer from 1 to {MAX_PAGE}", field="limit")
        if isinstance(after_sequence, bool) or not isinstance(after_sequence, int) or after_sequence < 0:
            raise ValidationFailed("after_sequence must be a non-negative integer", field="after_sequence")
        return self._page(scenario, after_sequence, limit)

    def _page(self, scenario: str, after_sequence: int, limit: int) -> list[Record]:
        params = {"scenario": scenario, "after": after_sequence, "limit": limit}
        with self._read() as conn:
            return [row_to_record(row) for row in conn.execute(q.PAGE, params)]

    def replay(self, scenario: str, after_sequence: int = 0) -> Iterator[Record]:
        """Every record of ``scenario`` after ``after_sequence``, oldest first, read page by page."""
        while True:
            batch = self._page(scenario, after_sequence, _REPLAY_PAGE)
            yield from batch
            if len(batch) < _REPLAY_PAGE:
                return
            after_sequence = batch[-1].sequence

    def count(self, scenario: str) -> int:
        """Number of records stored for ``scenario``."""
        with self._read() as conn:
            return int(conn.execute(q.COUNT, {"scenario": scenario}).scalar_one())

    def last_sequence(self, scenario: str) -> int:
        """The highest store sequence of ``scenario``'s records (0 when it has none)."""
        with self._read() as conn:
            return int(conn.execute(q.LAST_SEQUENCE, {"scenario": scenario}).scalar_one() or 0)

    def find_recent_by_request_hash(self, scenario: str, request_hash: str, within_s: float = 600) -> Record | None:
        """The newest record of ``scenario`` with ``request_hash`` created in the last ``within_s`` seconds.

        The server uses it to answer an SDK retry (``x-stainless-retry-count``) without recording twice.
        """
        params = {"scenario": scenario, "request_hash": request_hash, "since": time.time() - within_s}
        with self._read() as conn:
            row = conn.execute(q.RECENT_BY_REQUEST_HASH, params).first()
        return row_to_record(row) if row is not None else None

    def find_by_idempotency_key(self, scenario: str, key: str) -> Record | None:
        """The record an ``Idempotency-Key`` of ``scenario`` names now (its complete record, else its latest
        attempt), or ``None``."""
        with self._read() as conn:
            record_id = conn.execute(q.KEY_IN_SCENARIO, {"scenario": scenario, "key": key}).scalar()
        return self.get(scenario, record_id) if record_id is not None else None

    def check_references(self, scenario: str, ids: Sequence[str]) -> None:
        """Raise :class:`ValidationFailed` naming the first reference that is not one of ``scenario``'s inference
        records, or is listed twice."""
        info: dict = {}
        if isinstance(ids, (list, tuple)):  # anything else is refused by validate_references
            with self._read() as conn:
                info = fetch_ref_info(conn, [(scenario, i) for i in ids if isinstance(i, str)])
        validate_references(scenario, ids, lambda ref: info.get((scenario, ref)))

    # -- scenarios ----------------------------------------------------------------------------------------------

    def get_scenario(self, name: str) -> Scenario | None:
        """The scenario named ``name``, or ``None``."""
        with self._read() as conn:
            row = conn.execute(q.SCENARIO_BY_NAME, {"name": name}).first()
        return _scenario(row) if row is not None else None

    def get_or_create_scenario(self, name: str, recipe: str) -> tuple[Scenario, bool]:
        """Return ``(scenario, created)``. The recipe binding is permanent: an existing scenario bound to another
        recipe raises :class:`Conflict`. Safe against concurrent creation (in- and cross-process). An archived
        scenario is returned as is (``archived=True``); the caller decides what that means."""
        check_identifier("scenario", name)
        check_identifier("recipe", recipe)
        found = self.get_scenario(name)
        if found is None:
            found, created = self._call(lambda conn: _create_scenario(conn, self.dialect, name, recipe))
        else:
            created = False
        if found.recipe != recipe:
            raise Conflict(f"scenario {name!r} is bound to recipe {found.recipe!r}, not {recipe!r}",
                           scenario=name, recipe=found.recipe)
        return found, created

    def scenarios(self) -> list[Scenario]:
        """Every scenario, archived ones included, by name."""
        with self._read() as conn:
            return [_scenario(row) for row in conn.execute(q.ALL_SCENARIOS)]

    def archive_scenario(self, name: str) -> Scenario:
        """Mark ``name`` archived (its records stay). Raises :class:`NotFound` for an unknown scenario."""
        def archive(conn: sa.Connection) -> Scenario:
            conn.execute(q.ARCHIVE_SCENARIO, {"scenario_name": name})
            row = conn.execute(q.SCENARIO_BY_NAME, {"name": name}).first()
            if row is None:
                raise NotFound(f"unknown scenario {name!r}", scenario=name)
            return _scenario(row)

        return self._call(archive)

    # -- consumed ids -------------------------------------------------------------------------------------------

    def mark_consumed(self, scenario: str, ids: Iterable[str], step: int) -> int:
        """Record that commit ``step`` consumed ``ids``; an id already consumed keeps its first step.
        Returns how many ids were newly marked."""
        ids = list(dict.fromkeys(ids))
        for record_id in ids:
            check_identifier("record_id", record_id)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValidationFailed("step must be a non-negative integer", field="step")
        if not ids:
            return 0
        now = time.time()
        rows = [{"scenario": scenario, "record_id": i, "step": step, "consumed_at": now} for i in ids]

        def mark(conn: sa.Connection) -> int:
            return len(conn.execute(q.mark_consumed(self.dialect), rows).all())

        return self._call(mark)

    def consumed_ids(self, scenario: str) -> set[str]:
        """Ids of ``scenario`` that some commit consumed."""
        with self._read() as conn:
            return set(conn.execute(q.CONSUMED_IDS, {"scenario": scenario}).scalars())

    def is_consumed(self, scenario: str, record_id: str) -> bool:
        """Whether a commit consumed ``record_id`` in ``scenario``."""
        with self._read() as conn:
            return conn.execute(q.IS_CONSUMED, {"scenario": scenario, "record_id": record_id}).first() is not None

    # -- token usage (rate limits and budgets: reef_core.serve.middleware.usage) -------------------------------------------

    def add_usage(self, rows: Sequence[tuple[str, str, int, int]]) -> dict[tuple[str, str], tuple[int, int]]:
        """Add ``(key, period, tokens, requests)`` increments; returns each row's stored totals afterwards."""
        now = time.time()

        def add(conn: sa.Connection) -> dict[tuple[str, str], tuple[int, int]]:
            out = {}
            for key, period, tokens, requests in rows:
                params = {"key": key, "period": period, "tokens": tokens, "requests": requests, "updated_at": now}
                total = conn.execute(q.add_usage(self.dialect), params).one()
                out[(key, period)] = (int(total.tokens), int(total.requests))
            return out

        return self._call(add) if rows else {}

    def usage_rows(self, periods: Sequence[str]) -> list[tuple[str, str, int, int]]:
        """Stored ``(key, period, tokens, requests)`` counters of the given periods."""
        with self._read() as conn:
            return [(r.key, r.period, int(r.tokens), int(r.requests))
                    for r in conn.execute(q.USAGE_IN_PERIODS, {"periods": list(periods)})]

    def write_transaction(self, fn):
        """Run ``fn(connection)`` in one write transaction on the writer thread (queued with the appends, under the
        cross-process write lock on SQLite) and return its result: retention's compaction chunks."""
        return self._call(fn)

    # -- plumbing -----------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StorageUnavailable("the record store is closed")

    @contextmanager
    def _read(self) -> Iterator[sa.Connection]:
        self._check_open()
        try:
            with self._engines.reader.connect() as conn:
                yield conn
        except sa.exc.DBAPIError as exc:
            raise StorageUnavailable(f"record store read failed: {exc.orig}") from exc

    def _call(self, fn):
        self._check_open()
        return self._writer.submit_call(fn).result()


def _scenario(row) -> Scenario:
    return Scenario(name=row.name, recipe=row.recipe, created_at=float(row.created_at), archived=bool(row.archived))


def _create_scenario(conn: sa.Connection, dialect: str, name: str, recipe: str) -> tuple[Scenario, bool]:
    params = {"name": name, "recipe": recipe, "created_at": time.time(), "archived": False}
    created = conn.execute(q.create_scenario(dialect), params).first() is not None
    row = conn.execute(q.SCENARIO_BY_NAME, {"name": name}).one()
    return _scenario(row), created
