"""The digest of a model directory's files, hashed once per content and remembered across starts.

Why: a scenario's creation release names the base model by ``sha256`` over its files (SmolLM2: 273 MB, ~0.35 s of
CPU), and ``reef serve``'s first request to a new scenario waited for that hash, computed again at every start
(issue #41). :func:`model_digest` keeps the result in this user's cache (``~/.cache/reef/digests/``, one small JSON
file per directory) under a key of every file's relative path, size, modification and status-change times and inode;
any write to a file changes its status-change time (which no program can set back), so a key that matches names the
same bytes. A missing, foreign or unreadable cache file only means hashing again; one that cannot be written is
skipped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def hash_files(model_dir: Path) -> str:
    """``sha256:<hex>`` over every file of a model directory (relative path and bytes, in path order)."""
    digest = hashlib.sha256()
    root = Path(model_dir)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
        digest.update(b"\0")
    return f"sha256:{digest.hexdigest()}"


def cache_path(model_dir: Path) -> Path:
    from .loading import user_cache_dir

    name = hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:16]
    return user_cache_dir() / "digests" / f"{name}.json"


def _key(model_dir: Path) -> list:
    root = Path(model_dir)
    out = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        st = path.stat()
        out.append([path.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
    return [str(root.resolve()), out]


def model_digest(model_dir: Path) -> str:
    """:func:`hash_files` of ``model_dir``, read from the cache when its files are unchanged since it was hashed."""
    key = _key(model_dir)
    path = cache_path(model_dir)
    try:
        cached = json.loads(path.read_text())
        if isinstance(cached, dict) and cached.get("key") == key and isinstance(cached.get("digest"), str):
            return cached["digest"]
    except (OSError, ValueError):
        pass
    digest = hash_files(model_dir)
    if _key(model_dir) != key:
        return digest  # written to while hashed: do not remember a digest of bytes that may be gone
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as exc:
        log.debug("model digest not cached (%s)", exc)
        return digest
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump({"key": key, "digest": digest}, fh)
        os.replace(tmp, path)  # a concurrent reader finds the whole old file or the whole new one
    except OSError as exc:
        log.debug("model digest not cached (%s)", exc)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return digest
