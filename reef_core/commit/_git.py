"""Thin runner for the real ``git`` and ``git-lfs`` binaries used by the release store.

Every command, from ``init --bare`` to those that need binary stdin (``mktree``, ``cat-file --batch``), goes
through :meth:`Git.run`, which raises :class:`GitCommandError` on failure. No Python git library is loaded: a
serving process holds only what it uses (GitPython cost 2.6 MiB of RSS and its import time for one ``init``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from reef_core.errors import ConfigError

ZERO = "0" * 40

# Variables that would redirect git to another repository or work tree (e.g. when tests run
# inside a git hook); the store always names its git dir explicitly.
_REDIRECTING = (
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_NAMESPACE",
    "GIT_COMMON_DIR",
)

_INSTALL_HINT = (
    "Reef stores weight files with git-lfs. Install it (Debian/Ubuntu: `apt-get install git-lfs`, "
    "macOS: `brew install git-lfs`, others: https://git-lfs.com) and run `git lfs install` once. "
    "Note that the PyPI package `git-lfs` is only a downloader and does not provide the binary."
)


class GitCommandError(Exception):
    """A ``git`` command that exited non-zero: ``command`` (its argv), ``status``, ``stderr`` and ``stdout``."""

    def __init__(self, command: list[str], status: int | None, stderr: bytes | str = b"", stdout: bytes | str = b""):
        self.command, self.status, self.stderr, self.stdout = list(command), status, stderr, stdout
        err = stderr.decode(errors="replace") if isinstance(stderr, bytes) else str(stderr)
        super().__init__(f"{' '.join(self.command)} exited with {status}: {err.strip()}")


def _run(cmd: list[str], *, input: bytes | None = None, stdin=None, check: bool = True,
         env: dict[str, str] | None = None, timeout: float | None = 600) -> subprocess.CompletedProcess:
    """``cmd`` with :func:`git_env` and captured output; :class:`GitCommandError` when it fails and ``check``."""
    proc = subprocess.run(cmd, input=input, stdin=stdin, capture_output=True, env=git_env(env), timeout=timeout)
    if check and proc.returncode != 0:
        raise GitCommandError(cmd, proc.returncode, proc.stderr, proc.stdout)
    return proc


def check_git_lfs() -> str:
    """Return the ``git lfs version`` string; raise ConfigError when git or git-lfs is missing."""
    if shutil.which("git") is None:
        raise ConfigError("git is not installed or not on PATH; Reef's release store needs it.")
    if shutil.which("git-lfs") is None:
        raise ConfigError(f"git-lfs is not installed or not on PATH. {_INSTALL_HINT}")
    try:
        proc = subprocess.run(
            ["git", "lfs", "version"], capture_output=True, env=git_env(), timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"`git lfs version` could not run ({exc}). {_INSTALL_HINT}") from exc
    if proc.returncode != 0:
        msg = proc.stderr.decode(errors="replace").strip()
        raise ConfigError(f"`git lfs version` failed: {msg}. {_INSTALL_HINT}")
    return proc.stdout.decode().strip()


def git_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for git children: fixed identity, C locale, no prompts, no redirection."""
    env = {k: v for k, v in os.environ.items() if k not in _REDIRECTING}
    env.update(
        {
            "GIT_AUTHOR_NAME": "reef",
            "GIT_AUTHOR_EMAIL": "reef@localhost",
            "GIT_COMMITTER_NAME": "reef",
            "GIT_COMMITTER_EMAIL": "reef@localhost",
            "GIT_TERMINAL_PROMPT": "0",
            "LC_ALL": "C",
        }
    )
    if extra:
        env.update(extra)
    return env


class Git:
    """Commands against one git directory (a bare repository)."""

    def __init__(self, git_dir: Path):
        self.git_dir = Path(git_dir)

    @staticmethod
    def init_bare(git_dir: Path) -> None:
        """Create a bare repository at ``git_dir`` (``git init --bare`` reinitialises an existing one harmlessly)."""
        git_dir.parent.mkdir(parents=True, exist_ok=True)
        _run(["git", "init", "--bare", "--quiet", str(git_dir)], timeout=60)

    def run(
        self,
        *args: str,
        input: bytes | None = None,
        stdin=None,
        check: bool = True,
        config: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = 600,
    ) -> subprocess.CompletedProcess:
        cmd = ["git", "--git-dir", str(self.git_dir)]
        for key, value in (config or {}).items():
            cmd += ["-c", f"{key}={value}"]
        cmd += list(args)
        return _run(cmd, input=input, stdin=stdin, check=check, env=env, timeout=timeout)

    def out(self, *args: str, **kwargs) -> str:
        return self.run(*args, **kwargs).stdout.decode().strip()

    def cat_batch(self, names: list[str]) -> list[bytes | None]:
        """Contents of many objects in one ``cat-file --batch`` call; None for missing names."""
        if not names:
            return []
        data = self.run("cat-file", "--batch", input="".join(n + "\n" for n in names).encode()).stdout
        results: list[bytes | None] = []
        pos = 0
        for _ in names:
            eol = data.index(b"\n", pos)
            header = data[pos:eol].split()
            pos = eol + 1
            if len(header) != 3 or header[-1] in (b"missing", b"ambiguous"):
                results.append(None)
                continue
            size = int(header[2])
            results.append(data[pos : pos + size])
            pos += size + 1  # content is followed by a newline
        return results

    def config_get(self, key: str) -> str | None:
        proc = self.run("config", "--get", key, check=False)
        return proc.stdout.decode().strip() if proc.returncode == 0 else None
