"""Write git loose objects and git-lfs objects in this process, durably.

Publishing a release used to run a subprocess per step (``git lfs clean`` per weight file, ``hash-object``,
``mktree`` per directory, ``commit-tree``); each costs a fork and exec, and ``git lfs clean`` copies the weights
through a pipe. Here the same objects are written directly, in the formats git and git-lfs define:

* a loose object is ``zlib("<type> <size>\\0" + content)`` at ``objects/<2 hex>/<38 hex>`` of its SHA-1;
* an LFS object is the file's bytes at ``lfs/objects/<2>/<2>/<sha256>``, and the blob committed in its place
  is the pointer text git-lfs writes (``version``/``oid``/``size``), so ``git lfs pull``/``fsck`` read it as theirs.

Content-addressed: an object already present is not written again (only its mtime is touched, as git does, so
garbage collection's grace period restarts). Durability: every new file is written under a temporary name;
:meth:`ObjectWriter.sync` fsyncs them (concurrently), renames them into place and fsyncs each directory that
gained an entry, so once it returns, a ref naming these objects never points at something a power cut could lose.
"""

from __future__ import annotations

import hashlib
import os
import threading
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

LFS_POINTER = b"version https://git-lfs.github.com/spec/v1\noid sha256:%s\nsize %d\n"
_CHUNK = 1 << 22  # 4 MiB: large enough that hashing, not the syscall, dominates


class ObjectWriter:
    """Writes the objects of one release; call :meth:`sync` before any ref names them."""

    def __init__(self, git_dir: Path, lfs_objects: Path):
        self.objects = Path(git_dir) / "objects"
        self.lfs_objects = Path(lfs_objects)
        self._dirty: set[Path] = set()  # directories that gained an entry, fsynced by sync()
        self._pending: dict[Path, tuple[Path, object]] = {}  # final path -> (temporary path, open file)

    # ------------------------------------------------------------------ git objects

    def _object(self, kind: bytes, content: bytes | memoryview) -> str:
        header = b"%s %d\0" % (kind, len(content))
        digest = hashlib.sha1(header)
        digest.update(content)
        sha = digest.hexdigest()
        path = self.objects / sha[:2] / sha[2:]
        if path in self._pending or _freshen(path):
            return sha
        compressor = zlib.compressobj(1)  # git's default for loose objects (core.looseCompression)
        self._stage(path, [compressor.compress(header), compressor.compress(content), compressor.flush()])
        return sha

    def blob(self, content: bytes | memoryview) -> str:
        return self._object(b"blob", content)

    def tree(self, entries: dict[str, tuple[bool, str]]) -> str:
        """A tree of ``name -> (is_tree, sha)``, in git's order (a subtree sorts as if its name ended in '/')."""
        body = b"".join(
            (b"40000 " if is_tree else b"100644 ") + name.encode() + b"\0" + bytes.fromhex(sha)
            for name, (is_tree, sha) in sorted(entries.items(), key=lambda e: e[0] + "/" if e[1][0] else e[0])
        )
        return self._object(b"tree", body)

    def commit(self, tree: str, parent: str | None, message: str, when: int) -> str:
        ident = f"reef <reef@localhost> {when} +0000"
        lines = [f"tree {tree}"] + ([f"parent {parent}"] if parent else []) + [f"author {ident}", f"committer {ident}"]
        text = "\n".join(lines) + "\n\n" + message + ("" if message.endswith("\n") else "\n")
        return self._object(b"commit", text.encode())

    # ------------------------------------------------------------------ LFS objects

    def lfs_bytes(self, data: bytes | memoryview) -> tuple[str, int]:
        """Store ``data`` as an LFS object; return (sha256, size)."""
        oid = hashlib.sha256(data).hexdigest()
        path = self.lfs_path(oid)
        if path not in self._pending and not _freshen(path):
            self._stage(path, [data])
        return oid, len(data)

    def lfs_file(self, src: Path) -> tuple[str, int]:
        """Store the file at ``src`` as an LFS object, hashing it while it is copied (read once)."""
        digest = hashlib.sha256()
        size = 0
        tmp = self._tmp_dir() / f"reef-{uuid.uuid4().hex}"
        out = open(tmp, "wb")
        try:
            with open(src, "rb") as inp:
                while chunk := inp.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
            out.flush()
        except BaseException:
            out.close()
            tmp.unlink(missing_ok=True)
            raise
        oid = digest.hexdigest()
        path = self.lfs_path(oid)
        if path in self._pending or _freshen(path):
            out.close()
            tmp.unlink(missing_ok=True)
        else:
            self._mkdirs(path.parent)
            self._pending[path] = (tmp, out)
        return oid, size

    def lfs_path(self, oid: str) -> Path:
        return self.lfs_objects / oid[0:2] / oid[2:4] / oid

    @staticmethod
    def pointer(oid: str, size: int) -> bytes:
        return LFS_POINTER % (oid.encode(), size)

    # ------------------------------------------------------------------ durability

    def sync(self) -> None:
        """Make every object written so far durable under its name.

        Each new file was written under a temporary name; all are fsynced at once (concurrent fsyncs share the
        file system's journal commits, where one after another each waits for its own), then renamed into place,
        then every directory that gained an entry is fsynced the same way."""
        pending, self._pending = self._pending, {}
        try:
            _fsync_all([out.fileno() for _, out in pending.values()])
        finally:
            for _, out in pending.values():
                out.close()
        for path, (tmp, _) in pending.items():
            os.replace(tmp, path)  # same content under the same name: replacing a concurrent copy is harmless
            self._dirty.add(path.parent)
        dirty, self._dirty = self._dirty, set()
        fds = [os.open(d, os.O_RDONLY) for d in dirty]
        try:
            _fsync_all(fds)
        finally:
            for fd in fds:
                os.close(fd)

    def abort(self) -> None:
        """Drop what was written but not synced (a failed stage leaves no temporary files)."""
        pending, self._pending = self._pending, {}
        for tmp, out in pending.values():
            out.close()
            tmp.unlink(missing_ok=True)

    def __enter__(self) -> "ObjectWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.abort()

    def _tmp_dir(self) -> Path:
        # Beside the LFS objects (same file system, so the rename is atomic), where git-lfs keeps its own.
        tmp_dir = self.lfs_objects.parent / "tmp"
        self._mkdirs(tmp_dir)
        return tmp_dir

    def _mkdirs(self, directory: Path) -> None:
        missing = []
        while not directory.is_dir():
            missing.append(directory)
            directory = directory.parent
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:  # a concurrent writer made it
                continue
            self._dirty.add(d.parent)

    def _stage(self, path: Path, chunks) -> None:
        self._mkdirs(path.parent)
        tmp = path.parent / f"tmp_obj_{uuid.uuid4().hex}"  # git's own prefix for loose-object temporaries
        out = open(tmp, "wb")
        try:
            for chunk in chunks:
                out.write(chunk)
            out.flush()
        except BaseException:
            out.close()
            tmp.unlink(missing_ok=True)
            raise
        self._pending[path] = (tmp, out)


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _fsync_all(fds: list[int]) -> None:
    """fsync these descriptors concurrently; raises the first error."""
    global _POOL
    if len(fds) <= 1:
        for fd in fds:
            os.fsync(fd)
        return
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=16, thread_name_prefix="reef-fsync")
    for future in [_POOL.submit(os.fsync, fd) for fd in fds]:
        future.result()


def _freshen(path: Path) -> bool:
    """True when ``path`` exists (its mtime touched, as git freshens an object it would have written)."""
    try:
        os.utime(path)
        return True
    except FileNotFoundError:
        return False
    except PermissionError:  # read-only object files are common in shared repositories; existence is what counts
        return path.exists()
