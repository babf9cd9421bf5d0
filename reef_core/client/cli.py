"""The ``reef`` commands that talk to a running server through :class:`~reef_core.client.ReefClient`:

    reef report --score 1 --feedback "right" --reference <receipt> [--reference ...]
    reef records [--limit N] [--after SEQ]
    reef releases
    reef status                      (the scenario's learner; without a scenario, the whole deployment)
    reef harness pull DIR [--release-id ID]
    reef import FILE.jsonl [--batch-size N]   (records without calling a model; a progress bar on stderr)

Each takes ``--url`` (``REEF_URL``, else the local server ``http://127.0.0.1:8900``), ``--token`` (``REEF_TOKEN``),
``--scenario`` (``REEF_SCENARIO``) and ``--json``. Times print as ``YYYY-MM-DD HH:MM:SS`` in UTC, whichever form the
server sent (records carry epoch seconds, releases ISO 8601).
Tables use ``rich`` at a terminal when it is installed (``reef-core[client]``), else aligned plain text.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from datetime import datetime, timezone
from typing import Any, Callable

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2
#: Where ``reef serve`` listens by default (``server.port``), so a client command on the same machine needs no flag.
DEFAULT_URL = "http://127.0.0.1:8900"


def add_commands(sub) -> dict[str, Callable[[argparse.Namespace], int]]:
    """Add the client commands to the ``reef`` subparsers; returns ``{command: handler}``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help=f"Reef's address (default: $REEF_URL, else {DEFAULT_URL})")
    common.add_argument("--token", help="an inference token (default: $REEF_TOKEN)")
    common.add_argument("--scenario", help="the scenario (default: $REEF_SCENARIO)")
    common.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser("report", parents=[common], help="send a report on receipts of a running server")
    p.add_argument("--score", type=float)
    p.add_argument("--feedback", help="text, or a JSON object when it parses as one")
    p.add_argument("--reference", action="append", default=[], metavar="RECEIPT", help="a receipt (repeatable)")
    p.add_argument("--metadata", help="a JSON object")
    p.add_argument("--id", dest="report_id", help="the report's own id (a retry with it is stored once)")

    p = sub.add_parser("records", parents=[common], help="list a scenario's records")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--after", type=int, default=0, help="only records after this sequence number")

    sub.add_parser("releases", parents=[common], help="list a scenario's releases, newest first")
    sub.add_parser("status", parents=[common], help="a scenario's learner status (or the deployment's)")

    p = sub.add_parser("harness", parents=[common], help="pull a scenario's harness tree")
    p.add_argument("action", choices=["pull"])
    p.add_argument("directory")
    p.add_argument("--release-id", help="an earlier release (default: the one serving)")

    p = sub.add_parser("import", parents=[common], help="import records from a JSONL file without calling a model "
                                                        "(Reef envelopes or {\"messages\": [...], \"score\": ...})")
    p.add_argument("file", help="a JSONL file, or - for stdin")
    p.add_argument("--batch-size", type=int, default=500, help="records per request, each stored all-or-nothing")
    return {"report": _guarded(cmd_report), "records": _guarded(cmd_records), "releases": _guarded(cmd_releases),
            "status": _guarded(cmd_status), "harness": _guarded(cmd_harness), "import": _guarded(cmd_import)}


def _guarded(command):
    def run(args) -> int:
        from ..extras import require

        require("client", f"reef {args.command}")  # a ConfigError: `reef` exits 2 naming the extra
        from .errors import ReefClientError

        logging.getLogger("httpx").setLevel(logging.WARNING)  # `reef` logs at INFO; one line per request is noise
        try:
            return command(args)
        except ValueError as exc:
            print(f"reef: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except ReefClientError as exc:
            print(f"reef: error: {exc}", file=sys.stderr)
            return EXIT_RUNTIME
    return run


def _client(args, *, needs_scenario: bool = True):
    """The client the flags name; a missing scenario is refused naming the flag, before any request."""
    from .core import ReefClient

    scenario = args.scenario or os.environ.get("REEF_SCENARIO") or None
    if needs_scenario and scenario is None:
        raise ValueError(f"reef {args.command} needs a scenario: pass --scenario NAME or set REEF_SCENARIO")
    return ReefClient(args.url or os.environ.get("REEF_URL") or DEFAULT_URL, scenario=scenario, token=args.token)


def _json_arg(text: str | None, name: str, *, object_only: bool) -> Any:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        if object_only:
            raise ValueError(f"--{name} must be a JSON object") from None
        return text
    if isinstance(value, dict):
        return value
    if object_only:
        raise ValueError(f"--{name} must be a JSON object")
    return text


def _print_json(value) -> None:
    print(json.dumps(value, indent=2, ensure_ascii=False))


def readable_time(value) -> str:
    """A time as a person reads it (``YYYY-MM-DD HH:MM:SS`` UTC) from epoch seconds or an ISO 8601 string; ``""``
    for none, the text itself for anything else."""
    if isinstance(value, bool) or value is None or value == "":
        return ""
    try:
        when = (datetime.fromtimestamp(value, tz=timezone.utc) if isinstance(value, (int, float))
                else datetime.fromisoformat(str(value).replace("Z", "+00:00")))
    except (ValueError, OverflowError, OSError):
        return str(value)
    if when.tzinfo is not None:
        when = when.astimezone(timezone.utc)
    return when.strftime("%Y-%m-%d %H:%M:%S")


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    """A table: ``rich`` at a terminal when installed, else aligned plain text (whole ids, for pipes)."""
    cells = [[_cell(v) for v in row] for row in rows]
    try:
        if not sys.stdout.isatty():
            raise ImportError
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
        print(title)
        print("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
        for row in cells:
            print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
        return
    table = Table(title=title)
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in cells:
        table.add_row(*row)
    Console().print(table)


def cmd_report(args) -> int:
    with _client(args) as reef:
        answer = reef.report(score=args.score, feedback=_json_arg(args.feedback, "feedback", object_only=False),
                             references=args.reference or None,
                             metadata=_json_arg(args.metadata, "metadata", object_only=True),
                             report_id=args.report_id)
    if args.json:
        _print_json(answer)
    else:
        print(answer["agent_record_id"])
    return EXIT_OK


def cmd_records(args) -> int:
    if args.limit < 1:
        raise ValueError("--limit must be at least 1")
    with _client(args) as reef:
        rows = reef.records(after_sequence=args.after, limit=args.limit)
    if args.json:
        _print_json(rows)
        return EXIT_OK
    print_table(f"records of {reef.scenario}", ["seq", "id", "type", "created", "score", "references", "release"],
                [[r.get("sequence"), r.get("agent_record_id"), r.get("request_type"), readable_time(r.get("created_at")),
                  r.get("score"), " ".join(r.get("references") or ()), r.get("artifact_ref")] for r in rows])
    return EXIT_OK


def cmd_releases(args) -> int:
    with _client(args) as reef:
        rows = reef.releases()
    if args.json:
        _print_json(rows)
        return EXIT_OK
    print_table(f"releases of {reef.scenario}", ["", "release", "operation", "created", "parent"],
                [["*" if r.get("current") else "", r.get("release_id"), r.get("operation"),
                  readable_time(r.get("created_at")), r.get("parent_release_id")] for r in rows])
    return EXIT_OK


def cmd_status(args) -> int:
    with _client(args, needs_scenario=False) as reef:
        status = reef.status() if reef.scenario else reef.server_status()
    if args.json:
        _print_json(status)
        return EXIT_OK
    if reef.scenario:
        print_table(f"status of {reef.scenario}", ["key", "value"], [[k, v] for k, v in status.items()])
    else:
        scenarios = status.get("scenarios") or {}
        print_table("scenarios", ["scenario", "learner", "release"],
                    [[name, s.get("learner"), s.get("current_release_id")] for name, s in scenarios.items()])
    return EXIT_OK


def cmd_harness(args) -> int:
    with _client(args) as reef:
        tree = reef.harness(args.directory, release_id=args.release_id)
    summary = {"release_id": tree["release_id"], "directory": args.directory, **tree["written"]}
    if args.json:
        _print_json(summary)
    else:
        print(f"release {tree['release_id']} in {args.directory}: {len(summary['written'])} written, "
              f"{len(summary['deleted'])} deleted, {len(tree['files']) - len(summary['written'])} unchanged")
    return EXIT_OK


def cmd_import(args) -> int:
    """Read the whole file first (a bad line is named before anything is sent), then send it in batches."""
    from ..progress import Progress
    from .errors import ReefClientError
    from .imports import batches, read_jsonl

    reef = _client(args)
    try:
        scenario = reef._need_scenario()
        if args.file == "-":
            lines = list(read_jsonl(sys.stdin, scenario, "stdin"))
        else:
            try:
                with open(args.file, encoding="utf-8") as handle:
                    lines = list(read_jsonl(handle, scenario, args.file))
            except OSError as exc:
                raise ValueError(f"cannot read {args.file}: {exc.strerror}") from None
    except BaseException:
        reef.close()
        raise
    # Each envelope remembers its line, so a refusal naming records[i] of a request can name the line.
    origin: dict[int, int] = {}
    for number, envelopes in lines:
        for envelope in envelopes:
            origin[id(envelope)] = number
    total = sum(len(envelopes) for _, envelopes in lines)
    stored = 0
    with reef, Progress("importing", total, unit="record") as bar:
        for batch in batches((envelopes for _, envelopes in lines), args.batch_size):
            try:
                reef.import_records(batch, batch_size=len(batch))
            except ReefClientError as exc:
                found = re.search(r"records\[(\d+)\]", str(exc))
                where = f" (line {origin[id(batch[int(found.group(1))])]})" if found and int(
                    found.group(1)) < len(batch) else ""
                print(f"reef: error: {exc}{where}; {stored} records stored before it", file=sys.stderr)
                return EXIT_RUNTIME
            stored += len(batch)
            bar.advance(len(batch))
    summary = {"scenario": reef.scenario, "records": stored, "lines": len(lines)}
    if args.json:
        _print_json(summary)
    else:
        print(f"imported {stored} records from {len(lines)} lines into {reef.scenario}")
    return EXIT_OK
