"""Built-in artifact store: ``git`` (a bare repository with git-lfs for weights)."""

from __future__ import annotations

from pathlib import Path

from .. import hookimpl


def make_git_store(*, config, data_dir: Path):
    from ..commit.git_store import GitArtifactStore

    repository = config.artifact_repository or str(Path(data_dir) / "artifacts.git")
    return GitArtifactStore(repository, Path(data_dir) / "artifacts-work")


@hookimpl
def reef_register_artifact_stores(register):
    register("git", make_git_store, description="git repository (local bare repo or remote URL) with git-lfs")
