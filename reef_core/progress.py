"""Progress of long work on stderr: model conversion, ``reef import``, ``reef gc``, ``reef sweep``.

At a terminal it is a tqdm bar (tqdm comes with transformers; without it, the plain lines below). Elsewhere (a
log file, CI, a pipe) it is a plain line at each tenth of the work and at each named stage, so a long run never
sits silent and a log is not flooded: 10,000 imported records make about ten lines, not 10,000. A ``logger``
takes the plain lines instead of stderr (``reef serve``, whose log may be JSON lines).
"""

from __future__ import annotations

import logging
import sys
from typing import IO


class Progress:
    """``with Progress("importing", total=n, unit="record") as bar: bar.advance(k)``; ``bar.stage(name)`` ends the
    current stage (if any) and names the next one, for work counted in stages."""

    def __init__(self, what: str, total: int | None, *, unit: str = "item", logger: logging.Logger | None = None,
                 stream: IO[str] | None = None):
        self.what, self.total, self.unit, self.logger = what, total, unit, logger
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.note: str | None = None
        self._in_stage = False
        self._next_line = self._step()
        self.bar = None
        if logger is None and _isatty(self.stream):
            try:
                from tqdm.auto import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, desc=what, unit=unit, file=self.stream, leave=False)

    def _step(self) -> int:
        return max(1, (self.total or 0) // 10)

    def advance(self, n: int = 1) -> None:
        """``n`` more units done."""
        if n <= 0:
            return
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.done >= self._next_line or (self.total is not None and self.done >= self.total):
            self._line()
            while self._next_line <= self.done:
                self._next_line += self._step()

    def stage(self, name: str) -> None:
        """The current stage is done (when one was started) and ``name`` begins."""
        if self._in_stage:
            self.done += 1
            if self.bar is not None:
                self.bar.update(1)
        self._in_stage, self.note = True, name
        if self.bar is not None:
            self.bar.set_postfix_str(name)
        else:
            self._line()

    def _line(self) -> None:
        of = f"/{self.total}" if self.total is not None else ""
        text = f"{self.what}: {self.done}{of} {self.unit}s" + (f" ({self.note})" if self.note else "")
        if self.logger is not None:
            self.logger.info("%s", text)
        else:
            print(text, file=self.stream, flush=True)

    def close(self, finished: bool = True) -> None:
        """Stop the bar; ``finished`` also counts a stage still running as done."""
        if finished and self._in_stage:
            self._in_stage = False
            self.done += 1
            if self.bar is not None:
                self.bar.update(1)
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(finished=exc_type is None)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
