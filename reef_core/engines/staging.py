"""Directories handed to a serving engine are written aside and renamed into place, so a server never reads half of
one, and read back before they are handed over (a reload that fails can take a server down with it)."""

from __future__ import annotations

import contextlib
import shutil
import uuid
from pathlib import Path
from typing import Iterator

from reef_core.errors import UpstreamError


@contextlib.contextmanager
def staged_dir(target: Path) -> Iterator[Path]:
    """A fresh sibling of ``target`` to write into; it replaces ``target`` when the block succeeds, and is removed
    when it raises."""
    target = Path(target)
    tmp = target.with_name(target.name + f".tmp-{uuid.uuid4().hex[:6]}")
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_readable(path: Path, shapes: dict[str, tuple]) -> None:
    """Read back a written safetensors file's header: every tensor there with its shape (a short write raises)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        found = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    if found != shapes:
        raise UpstreamError(f"release file {path} does not read back as written")
