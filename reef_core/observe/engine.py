"""Connecting to the record database and bringing its schema to the current revision.

SQLite (default, ``<data_dir>/records.db``) runs in WAL mode with ``synchronous=FULL`` so a committed row survives a
crash or power loss; writers open transactions with ``BEGIN IMMEDIATE`` so two writers queue on the lock instead of
failing when one upgrades a read snapshot. Processes sharing one SQLite file (``server.workers``, replicas, ``reef
learn``) also take :func:`write_lock` around each write transaction: SQLite's own busy handler waits by sleeping
1 to 100 ms between tries, so a writer that commits back to back starved the others for up to a second; a kernel
file lock wakes the waiter when it is released. PostgreSQL is reached through psycopg 3; each store lives in its own
schema (default ``reef_records``) so tests and deployments sharing one database never collide.
"""

from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from reef_core.errors import ConfigError, StorageUnavailable
from reef_core.extras import require
from reef_core.observe.schema import HEAD_REVISION, VERSION_TABLE, metadata, version_table

try:
    import fcntl
except ImportError:  # not POSIX: SQLite's own busy handler alone
    fcntl = None

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
DEFAULT_PG_SCHEMA = "reef_records"
SQLITE_FILENAME = "records.db"
_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_SYNC_MODES = ("FULL", "EXTRA", "NORMAL")


@dataclass
class Engines:
    """The engines one store uses: ``writer`` for its writer thread, ``reader`` for queries, both schema-mapped."""

    writer: sa.Engine
    reader: sa.Engine
    raw: list[sa.Engine]  # the underlying engines, for dispose()
    dialect: str
    schema: str | None

    def dispose(self) -> None:
        for engine in self.raw:
            engine.dispose()


def resolve_url(url: str | None, data_dir: Path) -> sa.URL:
    """The SQLAlchemy URL for ``url`` (``None``: SQLite in ``data_dir``); plain ``postgresql://`` gets psycopg 3."""
    if url is None:
        data_dir = Path(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        return make_url(f"sqlite:///{(data_dir / SQLITE_FILENAME).resolve()}")
    try:
        parsed = make_url(url)
    except sa.exc.ArgumentError as exc:
        raise ConfigError(f"invalid record database URL: {exc}") from exc
    backend = parsed.get_backend_name()
    if backend == "postgresql":
        if parsed.get_driver_name() != "psycopg":
            parsed = parsed.set(drivername="postgresql+psycopg")
        require("postgres", "storage.records_url=postgresql://...")
        return parsed
    if backend == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            raise ConfigError("the record store needs a SQLite file; in-memory databases are not durable or shared")
        return parsed
    raise ConfigError(f"unsupported record database backend {backend!r} (use sqlite or postgresql)")


def _sqlite_engine(url: sa.URL, *, begin: str, synchronous: str, busy_timeout_ms: int) -> sa.Engine:
    engine = sa.create_engine(url, pool_size=4, max_overflow=8)

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):
        # Let SQLAlchemy's "begin" event below emit BEGIN instead of pysqlite's implicit, deferred one.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        mode = cursor.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise StorageUnavailable(f"SQLite refused WAL mode (got {mode!r}) for {url.database}")
        cursor.execute(f"PRAGMA synchronous={synchronous}")
        cursor.close()

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn):
        conn.exec_driver_sql(begin)

    return engine


class _FileLock:
    """An exclusive ``flock`` on ``path`` (created if missing), taken by one writer thread around each of its write
    transactions. The kernel drops it with its process, so a killed writer never leaves it held."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None

    def __enter__(self):
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def close(self) -> None:
        pass


def write_lock(engine: sa.Engine) -> _FileLock | _NoLock:
    """What a writer holds around each write transaction on ``engine``: a file lock beside a SQLite database
    (``<file>.writelock``, shared by every process writing it), nothing for PostgreSQL (row locks queue there).
    Call ``close()`` when done with it."""
    if engine.url.get_backend_name() != "sqlite" or fcntl is None:
        return _NoLock()
    return _FileLock(f"{engine.url.database}.writelock")


def create_engines(url: sa.URL, *, schema: str | None, synchronous: str = "FULL",
                   busy_timeout_ms: int = 30_000, pool_size: int = 4) -> Engines:
    """Open the engines for ``url``. ``schema`` applies to PostgreSQL only (``None`` there means the default)."""
    dialect = url.get_backend_name()
    if dialect == "sqlite":
        if schema is not None:
            raise ConfigError("schema= applies to PostgreSQL record stores only")
        synchronous = synchronous.upper()
        if synchronous not in _SYNC_MODES:
            raise ConfigError(f"synchronous must be one of {', '.join(_SYNC_MODES)}")
        writer = _sqlite_engine(url, begin="BEGIN IMMEDIATE", synchronous=synchronous,
                                busy_timeout_ms=busy_timeout_ms)
        reader = _sqlite_engine(url, begin="BEGIN", synchronous=synchronous, busy_timeout_ms=busy_timeout_ms)
        return Engines(writer=writer, reader=reader, raw=[writer, reader], dialect=dialect, schema=None)

    schema = schema or DEFAULT_PG_SCHEMA
    if not _SCHEMA_NAME.match(schema):
        raise ConfigError(f"invalid PostgreSQL schema name {schema!r} (lower-case letters, digits, underscores)")
    # synchronous_commit=on whatever the server default: a commit returns only once it is flushed to disk.
    engine = sa.create_engine(url, pool_size=pool_size, max_overflow=8, pool_pre_ping=True,
                              connect_args={"options": "-c synchronous_commit=on"})
    mapped = engine.execution_options(schema_translate_map={None: schema})
    return Engines(writer=mapped, reader=mapped, raw=[engine], dialect=dialect, schema=schema)


def ensure_schema(engines: Engines) -> None:
    """Bring the store's database to :data:`HEAD_REVISION`, as :meth:`RecordStore.open` does.

    A store already there is left as it is, and an empty database gets the tables of
    :mod:`reef_core.observe.schema` stamped at the head in one transaction, both without Alembic; anything else
    (an older store) goes through :func:`migrate`. So a process whose store needs no migration never loads Alembic
    and its templates (11 MiB of RSS, a tenth of the upstream proxy's). Serialised against other processes
    opening the same store: SQLite's ``BEGIN IMMEDIATE``, PostgreSQL's advisory lock."""
    engine = engines.raw[0]
    try:
        with engine.begin() as conn:
            _lock_store(conn, engines)
            mapped = conn.execution_options(schema_translate_map={None: engines.schema}) if engines.schema else conn
            inspector = sa.inspect(conn)
            if inspector.has_table(VERSION_TABLE, schema=engines.schema):
                stored = {row[0] for row in mapped.execute(sa.select(version_table.c.version_num))}
                if stored == {HEAD_REVISION}:
                    return
            elif not any(inspector.has_table(name, schema=engines.schema) for name in metadata.tables):
                metadata.create_all(mapped)
                version_table.create(mapped)
                mapped.execute(version_table.insert().values(version_num=HEAD_REVISION))
                return
    except sa.exc.OperationalError as exc:
        raise StorageUnavailable(f"record database unavailable: {exc.orig}") from exc
    migrate(engines)


def _lock_store(conn: sa.Connection, engines: Engines) -> None:
    if engines.dialect == "postgresql":
        # Two processes opening a fresh store at once would both create the schema and tables.
        lock_id = zlib.crc32(f"reef-records:{engines.schema}".encode())
        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({lock_id})")
        conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{engines.schema}"')


def migrate(engines: Engines, revision: str = "head") -> None:
    """Run ``alembic upgrade <revision>`` (default ``head``) on the store's database, serialised against other
    processes doing the same; an earlier revision builds a store as an older Reef left it (migration tests)."""
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["schema"] = engines.schema
    # A plain (unmapped) engine: the migrations name the schema themselves.
    engine = engines.raw[0]
    try:
        with engine.begin() as conn:
            _lock_store(conn, engines)
            config.attributes["connection"] = conn
            command.upgrade(config, revision)
    except sa.exc.OperationalError as exc:
        raise StorageUnavailable(f"record database unavailable: {exc.orig}") from exc


def current_revision(engines: Engines) -> str | None:
    """The Alembic revision the database is at (``None`` before the first migration)."""
    from alembic.migration import MigrationContext

    with engines.raw[0].connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE,
                                                     "version_table_schema": engines.schema})
        return ctx.get_current_revision()
