"""Log output of ``reef serve`` (and ``reef learn``): plain text for a terminal, or one JSON object a line.

``server.log_format=json`` puts every record on one line as ``{"ts", "level", "logger", "message", ...}``; a
request line (logger ``reef.access``) adds its fields (method, route, status, timings, scenario, receipt, token
counts: see :mod:`reef_core.serve.observe`). ``server.log_level`` sets the root level. Text keeps the terminal
format and shows request lines only at ``debug``; JSON shows them from ``info``.
"""

from __future__ import annotations

import json
import logging
import time

from ..errors import ConfigError

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error", "critical")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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
    handler.setFormatter(JsonFormatter() if server_cfg.log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # Request lines (INFO): as JSON from log_level=info down (a log pipeline wants them); as text only at debug.
    quiet = server_cfg.log_format == "text" and level > logging.DEBUG
    logging.getLogger("reef.access").setLevel(logging.WARNING if quiet else level)
