"""``reef export``: write a scenario's records as a dataset file (:mod:`reef_core.loop.export` says what each format
holds).

It reads the deployment's record store (``storage.records_url``, else SQLite under ``storage.data_dir``) and its
release chain, and writes nothing else: a data directory without a record store is refused, never created. Flags
are checked (:func:`check_flags`) before the config is composed; the file appears whole or not at all (written
beside ``--out`` and renamed). A summary (records written, left out) goes to stderr.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from ..errors import ConfigError, NotFound, ValidationFailed
from ..extras import require
from .export import FORMATS, LINE_FORMATS, ROW_FIELDS, Tally, json_line, parse_since, plan

FLAGS = {"format": "--format", "since": "--since", "release": "--release"}
#: Rows per Parquet row group (what is held in memory at once).
ROWS_PER_GROUP = 500


def check_flags(fmt: str, since: str | None, out: str | None) -> None:
    """The flags' own checks, before anything loads (:class:`ConfigError` naming the flag: exit 2)."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(FORMATS)}")
    if since is not None:
        try:
            parse_since(since, "--since")
        except ValidationFailed as exc:
            raise ConfigError(exc.message) from None
    if fmt not in LINE_FORMATS:
        require("export", f"--format {fmt}")
        if out is None:
            raise ConfigError(f"--out: --format {fmt} writes a {'directory' if fmt == 'hf' else 'file'}; name it")
    if out is not None:
        path = Path(out)
        if not path.parent.is_dir():
            raise ConfigError(f"--out {out!r}: the directory {str(path.parent)!r} does not exist")
        if path.is_dir() and (fmt != "hf" or any(path.iterdir())):
            raise ConfigError(f"--out {out!r} is a directory" + (" that is not empty" if fmt == "hf" else ""))


def run_export(cfg, *, scenario: str, fmt: str, since: str | None = None, release: str | None = None,
               scored_only: bool = False, out: str | None = None) -> int:
    from ..observe.records import RecordStore
    from ..observe.engine import SQLITE_FILENAME
    from ..plugins import get_plugin_manager

    check_flags(fmt, since, out)
    data_dir = Path(cfg.storage.data_dir)
    if cfg.storage.records_url is None and not (data_dir / SQLITE_FILENAME).is_file():
        raise ConfigError(f"storage.data_dir {str(data_dir)!r} holds no record store")
    options = {"schema": cfg.storage.records_schema} if cfg.storage.records_schema else {}
    store = RecordStore.open(cfg.storage.records_url, data_dir, **options)
    try:
        if store.get_scenario(scenario) is None:
            known = ", ".join(repr(s.name) for s in store.scenarios()[:20]) or "none"
            raise ConfigError(f"--scenario {scenario!r}: no such scenario (known: {known})")
        artifacts = get_plugin_manager().create("artifact_store", cfg.storage.artifact_store, config=cfg.storage,
                                                data_dir=data_dir)
        release_rows = [r.to_dict() for r in artifacts.releases(scenario)]
        tally = Tally()
        try:
            rows = plan(store.replay, scenario, release_rows, fmt, since=since, release=release,
                        scored_only=scored_only, names=FLAGS, tally=tally)
        except (ValidationFailed, NotFound) as exc:
            raise ConfigError(exc.message) from None
        _write(rows, fmt, out)
    finally:
        store.close()
    where = out or "stdout"
    print(f"reef export: {tally.written} {fmt} rows of {scenario!r} to {where} ({tally.skipped} left out: "
          "exchanges the format cannot hold, reports quoting records not exported)", file=sys.stderr)
    return 0


def _write(rows, fmt: str, out: str | None) -> None:
    if out is None:
        for row in rows:
            sys.stdout.write(json_line(row))
        return
    target = Path(out)
    with tempfile.TemporaryDirectory(prefix=".reef-export-", dir=target.parent) as work:
        staged = Path(work) / "export"
        if fmt in LINE_FORMATS:
            with staged.open("w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json_line(row))
        elif fmt == "parquet":
            write_parquet(rows, staged)
        else:
            write_hf(rows, staged, Path(work))
        if target.is_dir():  # an empty directory (hf), checked by check_flags
            target.rmdir()
        os.replace(staged, target)


def row_schema():
    """The Arrow schema of a dataset row (:data:`reef_core.loop.export.ROW_FIELDS`)."""
    import pyarrow as pa

    call = pa.struct([("id", pa.string()), ("type", pa.string()),
                      ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())]))])
    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.list_(call)),
                         ("tool_call_id", pa.string())])
    types = {"record_id": pa.string(), "scenario": pa.string(), "sequence": pa.int64(),
             "created_at": pa.timestamp("us", tz="UTC"), "content_hash": pa.string(), "dialect": pa.string(),
             "messages": pa.list_(message), "reply": message, "tools": pa.string(), "score": pa.float64(),
             "scores": pa.list_(pa.float64()), "feedback": pa.list_(pa.string()), "release": pa.string(),
             "version": pa.string(), "tags": pa.string()}
    return pa.schema([(name, types[name]) for name in ROW_FIELDS])


def write_parquet(rows, path: Path) -> None:
    """Rows to one Parquet file, a row group at a time."""
    import itertools

    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = row_schema()
    with pq.ParquetWriter(path, schema) as writer:
        rows = iter(rows)
        while group := list(itertools.islice(rows, ROWS_PER_GROUP)):
            writer.write_table(pa.Table.from_pylist(group, schema=schema))


def write_hf(rows, path: Path, work: Path) -> None:
    """Rows to a ``datasets`` directory (``Dataset.load_from_disk`` reads it), through a Parquet file."""
    import datasets

    parquet = work / "rows.parquet"
    write_parquet(rows, parquet)
    dataset = datasets.Dataset.from_parquet(str(parquet), cache_dir=str(work / "cache"))
    dataset.save_to_disk(str(path))
    del dataset
    parquet.unlink()
    shutil.rmtree(work / "cache", ignore_errors=True)

