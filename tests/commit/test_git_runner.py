"""The git runner of the release store: a bare repository made with the git binary, failures as GitCommandError."""

from __future__ import annotations

import pytest

from reef_core.commit._git import Git, GitCommandError


def test_init_bare_makes_a_repository_and_a_second_call_keeps_it(tmp_path):
    git_dir = tmp_path / "deep" / "releases.git"
    Git.init_bare(git_dir)
    git = Git(git_dir)
    assert git.out("rev-parse", "--is-bare-repository") == "true"
    blob = git.out("hash-object", "-w", "--stdin", input=b"kept")
    Git.init_bare(git_dir)
    assert git.cat_batch([blob]) == [b"kept"]


def test_a_failing_command_raises_with_its_status_and_stderr(tmp_path):
    Git.init_bare(tmp_path / "r.git")
    with pytest.raises(GitCommandError) as caught:
        Git(tmp_path / "r.git").run("cat-file", "-p", "0" * 40)
    error = caught.value
    assert error.status != 0 and error.command[:3] == ["git", "--git-dir", str(tmp_path / "r.git")]
    assert b"0000000000" in error.stderr or b"Not a valid" in error.stderr
    assert "cat-file" in str(error) and str(error.status) in str(error)
    assert Git(tmp_path / "r.git").run("cat-file", "-p", "0" * 40, check=False).returncode != 0


def test_init_bare_over_a_file_raises_naming_the_command(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(GitCommandError) as caught:
        Git.init_bare(blocker)
    assert caught.value.command[:3] == ["git", "init", "--bare"] and caught.value.stderr
