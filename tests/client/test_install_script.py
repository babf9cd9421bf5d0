"""``GET /reef/harness/install``: the script runs under ``sh`` (dash) in a temporary HOME against a live server."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from reef_core.client import ReefClient
from reef_core.client.tree import SIDECAR, read_sidecar

SH = shutil.which("dash") or "/bin/sh"
TREE_1 = {"AGENTS.md": "Run the tests first.\n", "skills/review/SKILL.md": "Review it.\nEOF\n'quoted' $HOME `x`",
          "notes/ü plan.md": "", "prompts/keep.md": "unchanged\n", 'say "hi".md': "quoted name\n"}
TREE_2 = {"AGENTS.md": "Run the tests first, always.\n", "prompts/keep.md": "unchanged\n", "new.md": "added\n"}


def _publish(reef: ReefClient, tree: dict) -> str:
    """Make ``tree`` the scenario's next release (FeedbackTreeTrainer) and return its id."""
    before = reef.releases() if reef.receipts.all() else []
    reef.openai().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    reef.report(score=1.0, feedback={"tree": tree})
    return reef.wait_for_release(after=_current(before), timeout=60)["release_id"]


def _current(rows):
    return next((r["release_id"] for r in rows if r.get("current")), None)


def _script(server, scenario: str, adapter: str = "generic", **params) -> str:
    response = httpx.get(f"{server.url}/reef/harness/install", params={"adapter": adapter, **params},
                         headers={"x-reef-scenario": scenario, "authorization": f"Bearer {server.token}"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/x-shellscript")
    return response.text


def _run(script: str, home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"HOME": str(home), "PATH": os.environ["PATH"], "REEF_PYTHON": sys.executable,
           "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "TMPDIR": str(home)}
    return subprocess.run([SH, "-s", *args], input=script.encode(), cwd=home, env=env, capture_output=True,
                          timeout=60)


def _snapshot(root: Path) -> dict:
    """Every path under ``root`` with its bytes and identity (inode, mtime): a write of any kind changes it."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            out[str(path)] = ("link", os.readlink(path))
        elif path.is_file():
            st = path.stat()
            out[str(path)] = (path.read_bytes(), st.st_ino, st.st_mtime_ns)
    return out


def _installed(dest: Path) -> dict:
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file()}


@pytest.fixture
def home(tmp_path):
    (tmp_path / "home").mkdir()
    return tmp_path / "home"


def test_install_update_and_refuse_a_damaged_script(live_reef, home):
    dest, prefix = home / "harness", home / "prefix"
    with ReefClient(live_reef.url, scenario="install", token=live_reef.token) as reef:
        first = _publish(reef, TREE_1)
        script_1 = _script(live_reef, "install")
        done = _run(script_1, home, str(dest), str(prefix))
        assert done.returncode == 0, done.stderr.decode()
        files = _installed(dest)
        assert files.pop(SIDECAR) and files.pop("reef.env").decode().count(live_reef.url) == 3
        assert files == {p: t.encode() for p, t in TREE_1.items()}  # byte-exact, including the unterminated file
        assert read_sidecar(dest)["release_id"] == first
        wrapper = prefix / "bin" / "reef-generic"
        assert os.access(wrapper, os.X_OK) and os.readlink(home / ".local/bin/reef-generic") == str(wrapper)
        assert f"REEF_HARNESS_DIR='{dest}'" in wrapper.read_text()

        before = _snapshot(home)
        again = _run(script_1, home, str(dest), str(prefix))
        assert again.returncode == 0 and b"nothing written" in again.stderr
        assert _snapshot(home) == before  # a second run writes nothing

        second = _publish(reef, TREE_2)
        done = _run(_script(live_reef, "install"), home, str(dest), str(prefix))
        assert done.returncode == 0, done.stderr.decode()
        files = _installed(dest)
        files.pop(SIDECAR), files.pop("reef.env")
        assert files == {p: t.encode() for p, t in TREE_2.items()}  # changed replaced, deleted removed
        assert not (dest / "skills").exists() and not (dest / "notes").exists()
        assert read_sidecar(dest)["release_id"] == second
        assert b"wrote prompts/keep.md" not in done.stderr  # an unchanged file is left alone

        # The first release's script, damaged in one file: it would install, but exits 1 and writes nothing.
        old = _script(live_reef, "install", release_id=first)
        assert "Review it." in old
        damaged = old.replace("Review it.", "Review it!", 1)
        before = _snapshot(home)
        refused = _run(damaged, home, str(dest), str(prefix))
        assert refused.returncode == 1 and b"checksum mismatch" in refused.stderr
        assert _snapshot(home) == before
        assert _run(old, home, str(dest), str(prefix)).returncode == 0  # intact, the same script rolls back
        assert read_sidecar(dest)["release_id"] == first


def test_opencode_adapter_and_forwarded_address(live_reef, home):
    with ReefClient(live_reef.url, scenario="install-oc", token=live_reef.token) as reef:
        _publish(reef, {"AGENTS.md": "Be careful.\n", "skills/a/SKILL.md": "A\n"})
    script = _script(live_reef, "install-oc", "opencode")
    done = _run(script, home, str(home / "oc"), str(home / "prefix"))
    assert done.returncode == 0, done.stderr.decode()
    import json

    config = json.loads((home / "oc" / "opencode.json").read_text())
    assert config["model"].startswith("reef/")
    assert config["provider"]["reef"]["options"]["baseURL"] == "{env:REEF_PROXY_URL}/v1"
    assert config["instructions"] == ["{env:REEF_HARNESS_DIR}/AGENTS.md"]
    wrapper = (home / "prefix" / "bin" / "reef-opencode").read_text()
    assert f"export OPENCODE_CONFIG='{home / 'oc'}/opencode.json'" in wrapper and "REEF_AGENT='opencode'" in wrapper

    forwarded = httpx.get(f"{live_reef.url}/reef/harness/install", params={"adapter": "generic",
                                                                          "scenario": "install-oc"},
                          headers={"authorization": f"Bearer {live_reef.token}",
                                   "x-forwarded-proto": "https", "x-forwarded-host": "reef.example:8443"})
    assert forwarded.status_code == 200 and "REEF_URL='https://reef.example:8443'" in forwarded.text


@pytest.mark.parametrize("params, headers, status, named", [
    ({}, {"x-reef-scenario": "install-oc"}, 400, "adapter"),
    ({"adapter": "nope"}, {"x-reef-scenario": "install-oc"}, 400, "adapter"),
    ({"adapter": "generic", "colour": "x"}, {"x-reef-scenario": "install-oc"}, 400, "colour"),
    ({"adapter": "generic"}, {}, 400, "x-reef-scenario"),
    ({"adapter": "generic", "scenario": "other"}, {"x-reef-scenario": "install-oc"}, 400, "scenario"),
    ({"adapter": "generic"}, {"x-reef-scenario": "no-such-scenario"}, 404, None),
    ({"adapter": "generic", "release_id": "0" * 40}, {"x-reef-scenario": "install-oc"}, 404, None),
    ({"adapter": "generic"}, {"x-reef-scenario": "install-oc", "x-forwarded-host": "a'b"}, 400, "host"),
])
def test_install_door(live_reef, params, headers, status, named):
    response = httpx.get(f"{live_reef.url}/reef/harness/install", params=params,
                         headers={**headers, "authorization": f"Bearer {live_reef.token}"})
    assert response.status_code == status, response.text
    if named:
        assert named in response.json()["error"]["message"]


def test_script_and_wrapper_are_shellcheck_clean(live_reef, home):
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck is not installed (scripts/setup.sh installs it)")
        pytest.skip("shellcheck is not installed")
    with ReefClient(live_reef.url, scenario="install-lint", token=live_reef.token) as reef:
        _publish(reef, {"AGENTS.md": "Lint me.\n", "odd 'name'.md": "no newline"})
    for adapter in ("generic", "opencode"):
        script = home / f"install-{adapter}.sh"
        script.write_text(_script(live_reef, "install-lint", adapter))
        assert _run(script.read_text(), home, str(home / adapter), str(home / "prefix")).returncode == 0
        wrapper = home / "prefix" / "bin" / f"reef-{adapter}"
        lint = subprocess.run([shellcheck, "-s", "sh", str(script), str(wrapper)], capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout


def test_install_before_the_first_request_serves_the_seed_release(reef_server, fake_upstream_url):
    """Issue #37: installing the harness is a normal first step, before any request. A scenario whose recipe serves
    a seed (its trainer's creation files) is created by the install route as its first request would create it;
    a token that may only read creates nothing."""
    server = reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                         "server.tokens=[all-token]", "recipe.surface=harness",
                         "recipe.trainer=reef_core.testing.step_trainer:StepTrainer",
                         "server.scoped_tokens=[{name: reader, token: read-token, scenarios: ['*'], scopes: [read]}]")
    server.token = "all-token"
    reader = {"x-reef-scenario": "fresh", "authorization": "Bearer read-token"}
    response = httpx.get(f"{server.url}/reef/harness/install", params={"adapter": "generic"}, headers=reader)
    assert response.status_code == 404, response.text
    listed = httpx.get(f"{server.url}/reef/scenarios", headers={"authorization": "Bearer all-token"}).json()
    assert "fresh" not in json.dumps(listed)  # the read-only token created nothing
    script = _script(server, "fresh")  # 200 before the scenario's first request
    assert "step 0" in script or "c3RlcCAw" in script  # the seed file, as text or base64
    harness = httpx.get(f"{server.url}/reef/harness", headers={"x-reef-scenario": "fresh",
                                                                 "authorization": "Bearer all-token"})
    assert harness.status_code == 200, harness.text
    assert harness.json()["files"] == {"system_prompt.md": "step 0"}
