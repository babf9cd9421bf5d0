"""Compare-and-swap ref transactions, on a local bare repository or a remote through a mirror.

An update names the value it expects (``old``): a 40-hex SHA, ``ZERO`` (must not exist yet) or
None (unconditional). A new value of ``ZERO`` deletes the ref. Every transaction is atomic: all
updates apply or none do. A lost race raises :class:`reef_core.errors.Conflict`.

Local: ``git update-ref --stdin`` (start/prepare/commit); git checks each old value under the
ref lock. One such process stays open per store and runs every transaction in turn (a fork and
exec per transaction cost more than the transaction); a failed transaction ends it and the next
one starts a new one. Refs are read from the files backend directly (:func:`_read_refs`).
Remote: ``git push --atomic --force-with-lease=<ref>:<old>`` from a local bare mirror; the
remote checks the lease under its ref locks.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
import weakref
from dataclasses import dataclass

from reef_core.commit._git import ZERO, Git, GitCommandError, git_env
from reef_core.errors import Conflict, StorageUnavailable

# Wait up to 2 s for a ref lock held by a concurrent writer instead of failing at once.
_LOCK_CONFIG = {"core.filesRefLockTimeout": "2000"}


@dataclass(frozen=True)
class RefUpdate:
    ref: str
    new: str  # ZERO deletes
    old: str | None  # None: unconditional, ZERO: must not exist


class LocalRefs:
    """Refs of a bare repository on this machine."""

    remote = False

    def __init__(self, git: Git):
        self.git = git
        self._session = _UpdateRefSession(git)

    def sync(self) -> None:
        """Nothing to fetch locally."""

    def snapshot(self, prefix: str = "refs/reef/") -> dict[str, str]:
        if prefix.endswith("/") and not (self.git.git_dir / "reftable").exists():
            found = _read_refs(self.git.git_dir, prefix)
            if found is not None:
                return found
        out = self.git.out("for-each-ref", "--format=%(refname) %(objectname)", prefix)
        return dict(line.split(" ", 1) for line in out.splitlines() if line)

    def get(self, ref: str) -> str | None:
        return self.snapshot(ref).get(ref)

    def upload_lfs(self, oids: set[str]) -> None:
        """Objects are already in this repository's LFS store."""

    def transaction(self, updates: list[RefUpdate], attempts: int = 3) -> None:
        script = ["start"]
        for u in updates:
            if u.new == ZERO:
                script.append(f"delete {u.ref}" + (f" {u.old}" if u.old else ""))
            elif u.old == ZERO:
                script.append(f"create {u.ref} {u.new}")
            else:
                script.append(f"update {u.ref} {u.new}" + (f" {u.old}" if u.old else ""))
        script += ["prepare", "commit"]
        payload = ("\n".join(script) + "\n").encode()
        for attempt in range(attempts):
            try:
                self._session.run(payload)
                return
            except GitCommandError as exc:
                _raise_if_stale(self.snapshot(), updates, exc)
                # Every expected value still holds: a lock stayed busy past the timeout.
                if attempt == attempts - 1:
                    raise StorageUnavailable(f"ref update failed: {_stderr(exc)}") from exc
                time.sleep(0.05 * (attempt + 1))


class RemoteRefs(LocalRefs):
    """Refs of a remote repository, worked through a local bare mirror (``origin``)."""

    remote = True

    def sync(self) -> None:
        try:
            self.git.run("fetch", "--prune", "--quiet", "origin", "+refs/reef/*:refs/reef/*")
        except GitCommandError as exc:
            raise StorageUnavailable(f"cannot fetch release refs: {_stderr(exc)}") from exc

    def get(self, ref: str) -> str | None:
        self.sync()
        return super().get(ref)

    def upload_lfs(self, oids: set[str]) -> None:
        if not oids:
            return
        try:
            self.git.run("lfs", "push", "--object-id", "origin", *sorted(oids))
        except GitCommandError as exc:
            raise StorageUnavailable(f"cannot upload LFS objects: {_stderr(exc)}") from exc

    def transaction(self, updates: list[RefUpdate], attempts: int = 1) -> None:
        # --no-verify: git-lfs installs a pre-push hook that would re-scan history; objects
        # are uploaded explicitly by oid (upload_lfs) before any ref naming them is pushed.
        args = ["push", "--no-verify", "--atomic", "--porcelain", "origin"]
        specs = []
        for u in updates:
            if u.old is None:
                specs.append(("+" if u.new != ZERO else "") + (u.new if u.new != ZERO else "") + ":" + u.ref)
                continue
            args.append(f"--force-with-lease={u.ref}:{'' if u.old == ZERO else u.old}")
            specs.append((u.new if u.new != ZERO else "") + ":" + u.ref)
        proc = self.git.run(*args, *specs, check=False, config=_LOCK_CONFIG)
        if proc.returncode != 0:
            text = (proc.stdout + proc.stderr).decode(errors="replace")
            if "stale info" in text or "[rejected]" in text:
                raise Conflict(
                    "release ref moved on the remote (lost compare-and-swap)",
                    refs=[u.ref for u in updates],
                )
            raise StorageUnavailable(f"push to the release remote failed: {text.strip()}")
        # Mirror what the remote now holds, so local reads see it without a fetch.
        LocalRefs.transaction(self, [RefUpdate(u.ref, u.new, None) for u in updates])


def _read_refs(git_dir, prefix: str) -> dict[str, str] | None:
    """The refs under ``prefix`` read from the files backend (loose files, then ``packed-refs``), as
    ``for-each-ref`` lists them but without a child process; None when something needs git itself (a symbolic ref).

    Loose files are read before ``packed-refs``: git writes a packed value before deleting its loose file and
    rewrites ``packed-refs`` before deleting a loose ref, so this order never misses a ref that exists."""
    loose: dict[str, str] = {}
    root = os.path.join(git_dir, prefix)
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            if name.endswith(".lock"):
                continue
            path = os.path.join(dirpath, name)
            try:
                with open(path, "rb") as fh:
                    value = fh.read().strip().decode("ascii", "replace")
            except (FileNotFoundError, IsADirectoryError):
                continue
            if not _SHA.fullmatch(value):
                return None
            loose[prefix + os.path.relpath(path, root).replace(os.sep, "/")] = value
    found: dict[str, str] = {}
    try:
        with open(os.path.join(git_dir, "packed-refs"), "rb") as fh:
            packed = fh.read().decode("utf-8", "replace")
    except FileNotFoundError:
        packed = ""
    for line in packed.splitlines():
        if line.startswith(("#", "^")) or " " not in line:
            continue
        sha, ref = line.split(" ", 1)
        if ref.startswith(prefix):
            found[ref] = sha
    found.update(loose)
    return dict(sorted(found.items()))


_SHA = re.compile(r"[0-9a-f]{40}")


class _UpdateRefSession:
    """A long-lived ``git update-ref --stdin``: each transaction is written to it and its ``commit: ok`` awaited.

    git reports ``<command>: ok`` for every start/prepare/commit and exits (non-zero, message on stderr) when one
    fails; the caller then sees the same GitCommandError a one-shot ``update-ref`` would raise."""

    def __init__(self, git: Git):
        self.cmd = ["git", "--git-dir", str(git.git_dir)]
        for key, value in _LOCK_CONFIG.items():
            self.cmd += ["-c", f"{key}={value}"]
        self.cmd += ["update-ref", "--stdin"]
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._finalizer = None

    def run(self, payload: bytes) -> None:
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                proc = self._proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                     stderr=subprocess.PIPE, env=git_env())
                if self._finalizer is not None:
                    self._finalizer.detach()
                self._finalizer = weakref.finalize(self, _close, proc)
            try:
                proc.stdin.write(payload)
                proc.stdin.flush()
                while (line := proc.stdout.readline()) not in (b"commit: ok\n", b""):
                    pass
            except OSError:  # the process died under us (broken pipe)
                line = b""
            if line:
                return
            self._proc = None
            _close(proc)
            raise GitCommandError(self.cmd, proc.returncode, proc.stderr.read() if proc.stderr else b"", b"")

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                _close(self._proc)
                self._proc = None


def _close(proc: subprocess.Popen) -> None:
    """End a session: closing stdin outside a transaction makes git exit cleanly."""
    try:
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for stream in (proc.stdout,):
        if stream is not None:
            stream.close()


def _raise_if_stale(current: dict[str, str], updates: list[RefUpdate], exc: Exception) -> None:
    for u in updates:
        if u.old is None:
            continue
        have = current.get(u.ref, ZERO)
        if have != u.old:
            raise Conflict(
                f"{u.ref} is at {have[:12] if have != ZERO else 'nothing'}, "
                f"expected {u.old[:12] if u.old != ZERO else 'nothing'} (lost compare-and-swap)",
                ref=u.ref,
                expected=None if u.old == ZERO else u.old,
                actual=None if have == ZERO else have,
            ) from exc


def _stderr(exc: GitCommandError) -> str:
    err = exc.stderr
    if isinstance(err, bytes):
        err = err.decode(errors="replace")
    return str(err).strip()
