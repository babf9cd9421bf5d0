"""Compare-and-swap ref transactions, on a local bare repository or a remote through a mirror.

An update names the value it expects (``old``): a 40-hex SHA, ``ZERO`` (must not exist yet) or
None (unconditional). A new value of ``ZERO`` deletes the ref. Every transaction is atomic: all
updates apply or none do. A lost race raises :class:`reef_core.errors.Conflict`.

Local: ``git update-ref --stdin`` (start/prepare/commit); git checks each old value under the
ref lock. GitPython's own ref writer does not compare old values, so it is never used here.
Remote: ``git push --atomic --force-with-lease=<ref>:<old>`` from a local bare mirror; the
remote checks the lease under its ref locks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from git.exc import GitCommandError

from reef_core.commit._git import ZERO, Git
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

    def sync(self) -> None:
        """Nothing to fetch locally."""

    def snapshot(self, prefix: str = "refs/reef/") -> dict[str, str]:
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
                self.git.run("update-ref", "--stdin", input=payload, config=_LOCK_CONFIG)
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
        local = LocalRefs(self.git)
        local.transaction([RefUpdate(u.ref, u.new, None) for u in updates])


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
