"""A pulled harness tree on disk: the ``.reef-harness-release`` sidecar and the tree digest.

The sidecar names the installed release and every file it wrote with its SHA-256::

    {
     "release_id": "...",
     "content_id": "...",
     "tree_sha256": "...",
     "files": [
      {"sha256": "<64 hex>", "path": "skills/a/SKILL.md"},
      ...
     ]
    }

It is JSON with a fixed layout, one file per line, so that the POSIX ``sh`` install script can list the previous
release's paths with ``sed`` (harness paths hold no backslash or control character: the only escape in a path is
``\\"``). The Python client (:func:`write_tree`) and the install script write the same bytes.

The tree digest is one SHA-256 over ``path LF length LF bytes`` frames in sorted path order (paths compared as
UTF-8 bytes), so a file moved, cut or appended to changes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

SIDECAR = ".reef-harness-release"


def encode_files(files: dict[str, str]) -> dict[str, bytes]:
    return {path: text.encode("utf-8") for path, text in files.items()}


def sorted_paths(files) -> list[str]:
    return sorted(files, key=lambda p: p.encode("utf-8"))


def tree_digest(files: dict[str, bytes]) -> str:
    digest = hashlib.sha256()
    for path in sorted_paths(files):
        data = files[path]
        digest.update(path.encode("utf-8") + b"\n" + str(len(data)).encode() + b"\n")
        digest.update(data)
    return digest.hexdigest()


def sidecar_text(release_id: str, content_id: str | None, files: dict[str, bytes]) -> str:
    lines = ["{",
             f' "release_id": {json.dumps(release_id)},',
             f' "content_id": {json.dumps(content_id)},',
             f' "tree_sha256": "{tree_digest(files)}",',
             ' "files": [']
    paths = sorted_paths(files)
    for i, path in enumerate(paths):
        comma = "," if i < len(paths) - 1 else ""
        sha = hashlib.sha256(files[path]).hexdigest()
        lines.append(f'  {{"sha256": "{sha}", "path": {json.dumps(path, ensure_ascii=False)}}}{comma}')
    lines += [" ]", "}"]
    return "\n".join(lines) + "\n"


def read_sidecar(directory: str | os.PathLike) -> dict | None:
    """The sidecar in ``directory`` as a dict, or None when there is none (or it is unreadable)."""
    try:
        return json.loads((Path(directory) / SIDECAR).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _safe(path: str) -> bool:
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def _atomic_write(target: Path, data: bytes) -> bool:
    """Write ``data`` to ``target`` through a temporary file and a rename; False when it already held them."""
    try:
        if target.read_bytes() == data:
            return False
    except OSError:
        pass
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".reef-")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def write_tree(directory: str | os.PathLike, release_id: str, content_id: str | None,
               files: dict[str, str]) -> dict:
    """Make ``directory`` hold exactly ``files`` of the release (plus its sidecar): changed files are replaced
    atomically, files the previous sidecar listed that the release lacks are deleted, unchanged ones are left alone.
    Returns ``{"written": [...], "deleted": [...]}``."""
    root = Path(directory)
    data = encode_files(files)
    for path in data:
        if not _safe(path):
            raise ValueError(f"refusing harness path {path!r}")
    previous = read_sidecar(root) or {}
    old = [row.get("path") for row in previous.get("files") or () if isinstance(row, dict)]
    deleted = []
    for path in old:
        if isinstance(path, str) and _safe(path) and path not in data and (root / path).is_file():
            (root / path).unlink()
            deleted.append(path)
    written = [path for path in sorted_paths(data) if _atomic_write(root / path, data[path])]
    _atomic_write(root / SIDECAR, sidecar_text(release_id, content_id, data).encode("utf-8"))
    return {"written": written, "deleted": deleted}
