"""Log output of ``reef serve`` (and ``reef learn``): plain text for a terminal, or one JSON object a line.

``server.log_format=json`` puts every record on one line as ``{"ts", "level", "logger", "message", ...}``; a
request line (logger ``reef.access``) adds its fields (method, route, status, timings, scenario, receipt, token
counts: see :mod:`reef_core.serve.middleware.observe`). ``server.log_level`` sets the root level. Text keeps the terminal
format and shows request lines only at ``debug``; JSON shows them from ``info``.
"""

from __future__ import annotations

import json
import logging
import re
import time

from reef_core.errors import ConfigError

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error", "critical")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _escape(char: int) -> str:
    return {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}.get(char, f"\\x{char:02x}" if char < 0x100 else f"\\u{char:04x}")


#: Control characters (C0, DEL, C1) and the Unicode line and paragraph separators, as escapes: what a client's
#: string could use to start a line of its own (or to drive a terminal) in a text log.
_CONTROLS = {c: _escape(c) for c in [*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029]}
_BREAKS = {c: e for c, e in _CONTROLS.items() if c != 0x0A}
#: Lines of a traceback that start at the margin: its header, the chaining sentences and ``Type: message``.
_TRACEBACK_MARGIN = re.compile(r"Traceback \(most recent call last\):$|During handling of the above exception|"
                               r"The above exception was the direct cause|[A-Za-z_][\w.]*(: |$)")


class SafeTextFormatter(logging.Formatter):
    """The text format, with every client string made harmless in one place: control characters of the message
    (its arguments carry paths, scenario names, header values) are escaped, so no request can write a log line of
    its own. A traceback keeps its line breaks; a line of it that Python would not start at the margin (an
    exception message's own line break) is indented. The JSON format needs none of this: ``json.dumps`` escapes."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = record.message.translate(_CONTROLS)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:
        return _margin(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _margin(super().formatStack(stack_info))


def _margin(text: str) -> str:
    lines = text.translate(_BREAKS).split("\n")
    return "\n".join(line if not line or line[0] == " " or _TRACEBACK_MARGIN.match(line) else "    " + line
                      for line in lines)


class JsonFormatter(logging.Formatter):
    """One JSON object per record; the fields a request line carries come from ``extra={"reef": {...}}``."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        fields = getattr(record, "reef", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def check(server_cfg) -> None:
    """Refuse an unknown ``server.log_format`` or ``server.log_level`` naming the key."""
    if server_cfg.log_format not in FORMATS:
        raise ConfigError(f"server.log_format must be one of {', '.join(FORMATS)} (got {server_cfg.log_format!r})")
    if str(server_cfg.log_level).lower() not in LEVELS:
        raise ConfigError(f"server.log_level must be one of {', '.join(LEVELS)} (got {server_cfg.log_level!r})")


def configure(server_cfg) -> None:
    """Point the root logger at stderr in the configured format and level."""
    check(server_cfg)
    level = getattr(logging, str(server_cfg.log_level).upper())
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if server_cfg.log_format == "json" else SafeTextFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # Request lines (INFO): as JSON from log_level=info down (a log pipeline wants them); as text only at debug.
    quiet = server_cfg.log_format == "text" and level > logging.DEBUG
    logging.getLogger("reef.access").setLevel(logging.WARNING if quiet else level)
