"""Compose the config in a child process that exits, for ``reef serve``.

Composition needs Hydra, OmegaConf and the ANTLR runtime of the override grammar: ~12 MiB of a server's resident
memory that nothing reads once the config is plain objects (issue #41), and ~0.3 s of one core. ``reef serve`` forks
before loading them; the child composes and sends back the :class:`ReefConfig` (dataclasses, dicts and lists,
pickled as ``server.workers`` already hands it to its workers) and exits. Meanwhile the server imports and loads what
does not depend on the config, on the other core.

A config error is the child's :class:`ReefError`, raised again in the server as if it had composed itself; the log
lines the child wrote while composing (a plugin that failed to load) are shown then. On success they are dropped: the
server loads the plugins itself and logs its own. Where a fork is not safe (no ``os.fork``, or threads already
running) the config is composed in-process.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import traceback
from collections.abc import Callable, Iterable

from ..errors import ReefError
from ..plugins import log as plugins_log
from .schema import ReefConfig


def can_fork() -> bool:
    """A fork copies only the calling thread: with other threads running, a lock one of them held would stay held
    in the child forever."""
    return hasattr(os, "fork") and threading.active_count() == 1


def compose_apart(overrides: Iterable[str], meanwhile: Callable[[], None] | None = None) -> ReefConfig:
    """The composed config (:func:`reef_core.config.compose_config`), composed in a forked child; ``meanwhile``
    runs in this process while the child composes. Raises what composing raised."""
    overrides = list(overrides)
    if not can_fork():
        return _here(overrides, meanwhile)
    for stream in (sys.stdout, sys.stderr):  # else what is buffered now would be written twice, once by the child
        stream.flush()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: coverage does not follow a fork that ends in os._exit
        os.close(read_end)
        _child(overrides, write_end)
    os.close(write_end)
    try:
        if meanwhile is not None:
            meanwhile()
        data = _read_all(read_end)
    finally:
        os.close(read_end)
        _, status = os.waitpid(pid, 0)
    return _outcome(data, status)


def _here(overrides: list[str], meanwhile: Callable[[], None] | None) -> ReefConfig:
    import gc

    from .compose import compose_config

    if meanwhile is not None:
        meanwhile()
    cfg = compose_config(overrides)
    gc.collect()  # the composition's cycles (OmegaConf nodes, parse trees), while little else exists: ~0.02 s
    return cfg


def _child(overrides: list[str], write_end: int) -> None:  # pragma: no cover - runs in the forked child
    """Compose, write the pickled outcome, exit without running the server's exit handlers."""
    code = 0
    try:
        records = _capture_logs()
        try:
            from .compose import compose_config

            outcome = ("config", compose_config(overrides), records)
        except ReefError as exc:
            outcome = ("error", _portable(exc), records)
        data = pickle.dumps(outcome)
    except BaseException:  # a bug, or Ctrl-C: the server reports it
        data = pickle.dumps(("crash", traceback.format_exc(), []))
        code = 1
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(write_end, view):]
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _capture_logs() -> list[tuple[str, int, str]]:  # pragma: no cover - runs in the forked child
    """Keep the child's log records (logger, level, message) instead of writing them."""
    records: list[tuple[str, int, str]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
            records.append((record.name, record.levelno, text))

    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(Keep())
    return records


def _portable(exc: ReefError) -> ReefError:  # pragma: no cover - runs in the forked child
    """The error itself if it survives pickling, else a ReefError of the same message (a subclass with another
    constructor)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return ReefError(exc.message)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _outcome(data: bytes, status: int) -> ReefConfig:
    if not data:
        raise ReefError(f"composing the config failed: its process ended without an answer "
                        f"({_how_it_ended(status)})")
    kind, value, records = pickle.loads(data)
    if kind == "crash":
        raise RuntimeError(f"composing the config failed in its process:\n{value}")
    for name, level, text in records:
        # The plugin loader's lines are the server's to repeat when it loads the plugins itself.
        if kind == "error" or name != plugins_log.name:
            logging.getLogger(name).log(level, "%s", text)
    if kind == "error":
        raise value
    return value


def _how_it_ended(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)  # minus the signal's number for a process a signal ended
    return f"signal {-code}" if code < 0 else f"exit status {code}"
