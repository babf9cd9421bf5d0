"""Fixtures for the release-store tests: real git, real git-lfs, throwaway repositories."""

from __future__ import annotations

import subprocess

import pytest

from reef_core.commit import GitArtifactStore


@pytest.fixture
def release_store(tmp_path) -> GitArtifactStore:
    return GitArtifactStore(tmp_path / "artifacts.git", tmp_path / "work")


def _git(*args: str, cwd=None, env=None) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"git {' '.join(args)} failed: {proc.stderr}"
    return proc.stdout


@pytest.fixture
def git():
    """Run the real git CLI (as a user of the repository would) and return stdout."""
    return _git
