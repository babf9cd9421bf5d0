"""Release routes and crash recovery over real HTTP, real git and a real `reef serve` process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import httpx
import pytest

from reef_core.commit.commitlog import CommitLog
from reef_core.commit.committer import Committer
from reef_core.commit.git_store import GitArtifactStore

ADMIN = {"authorization": "Bearer admin-secret"}
INFER = {"authorization": "Bearer infer-secret"}


def _tokens():
    return ["server.tokens=[infer-secret]", "server.admin_tokens=[admin-secret]"]


@pytest.fixture
def data_dir(tmp_path, reef_server, fake_upstream_url):
    """A data directory whose scenario 'rel' exists (created by a real request), server stopped."""
    directory = tmp_path / "data"
    server = reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}", *_tokens(),
                         data_dir=directory)
    chat(server, "rel")
    server.stop()
    return directory


def chat(server, scenario):
    response = httpx.post(f"{server.url}/v1/chat/completions", headers={**INFER, "x-reef-scenario": scenario},
                          json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200, response.text
    return response


def committer(data_dir):
    store = GitArtifactStore(data_dir / "artifacts.git", data_dir / "artifacts-work")
    return Committer(store, CommitLog.for_scenario(data_dir / "commits", "rel"), "rel")


def test_release_list_rollback_promote_delete(data_dir, reef_server, fake_upstream_url):
    c = committer(data_dir)
    a, _ = c.publish({"prompt.md": b"version one"}, expected_head=None, consumed_ids=["r1"])
    b, _ = c.publish({"prompt.md": b"version two"}, expected_head=a.release_id, consumed_ids=["r2"])
    held, _ = c.publish({"prompt.md": b"version three"}, expected_head=b.release_id, hold=True)
    c.log.close()

    server = reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}", *_tokens(),
                         data_dir=data_dir)
    url = f"{server.url}/reef/scenarios/rel"
    rows = httpx.get(f"{url}/releases", headers=INFER).json()["releases"]
    by_id = {r["release_id"]: r for r in rows}
    assert by_id[b.release_id]["current"] and not by_id[a.release_id]["current"]
    assert by_id[held.release_id]["pending"] and not by_id[held.release_id]["current"]
    chain = [r["release_id"] for r in rows if not r["pending"]]
    assert chain == [b.release_id, a.release_id]  # newest first

    assert httpx.post(f"{url}/rollback", json={"release_id": a.release_id}, headers=INFER).status_code == 403
    rolled = httpx.post(f"{url}/rollback", json={"release_id": a.release_id}, headers=ADMIN)
    assert rolled.status_code == 200, rolled.text
    assert rolled.json()["content_id"] == a.content_id and rolled.json()["release_id"] != a.release_id
    rows = httpx.get(f"{url}/releases", headers=INFER).json()["releases"]
    assert rows[0]["release_id"] == rolled.json()["release_id"] and rows[0]["operation"] == "rollback"
    assert rows[0]["current"] and {a.release_id, b.release_id} <= {r["release_id"] for r in rows}

    assert httpx.post(f"{url}/rollback", json={"release_id": "f" * 40}, headers=ADMIN).status_code == 404
    assert httpx.post(f"{url}/rollback", json={"nope": 1}, headers=ADMIN).status_code == 400
    assert httpx.post(f"{url}/promote", json={"release_id": a.release_id}, headers=ADMIN).status_code == 409

    promoted = httpx.post(f"{url}/promote", json={"release_id": held.release_id}, headers=ADMIN)
    assert promoted.status_code == 200, promoted.text
    assert promoted.json()["content_id"] == held.content_id
    commits = httpx.get(f"{url}/commits", headers=INFER).json()["commits"]
    assert [row["operation"] for row in commits] == ["training", "training", "training", "rollback", "promote"]
    only_r2 = httpx.get(f"{url}/commits", params={"record_id": "r2"}, headers=INFER).json()["commits"]
    assert [row["release_id"] for row in only_r2] == [b.release_id]

    assert httpx.delete(url, headers=INFER).status_code == 403
    deleted = httpx.delete(url, headers=ADMIN)
    assert deleted.status_code == 200 and deleted.json() == {"scenario": "rel", "archived": True}
    assert httpx.get(f"{url}/releases", headers=INFER).status_code == 404
    archived = GitArtifactStore(data_dir / "artifacts.git", data_dir / "artifacts-work").archived("rel")
    assert archived and archived[0]["release_id"] == promoted.json()["release_id"]


def test_dashboard_promotes_a_held_release_for_an_admin_only(data_dir, reef_server, fake_upstream_url):
    c = committer(data_dir)
    a, _ = c.publish({"prompt.md": b"version one"}, expected_head=None, consumed_ids=["r1"])
    held, _ = c.publish({"prompt.md": b"version two"}, expected_head=a.release_id, hold=True)
    c.log.close()
    server = reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}", *_tokens(),
                         data_dir=data_dir)
    page_url = f"{server.url}/ui/scenarios/rel"
    infer, admin = {"reef_ui_token": "infer-secret"}, {"reef_ui_token": "admin-secret"}
    link = f"/ui/scenarios/rel/promote?release_id={held.release_id}"
    assert link not in httpx.get(page_url, cookies=infer).text  # read-only for an inference token
    assert link in httpx.get(page_url, cookies=admin).text
    confirm = httpx.get(server.url + link, cookies=admin)
    assert confirm.status_code == 200 and "Confirm promote" in confirm.text and held.release_id in confirm.text
    csrf = re.search(r'name="csrf" value="([^"]+)"', confirm.text).group(1)  # the session's form token
    form = {"release_id": held.release_id, "confirm": "yes", "csrf": csrf}
    assert httpx.post(f"{page_url}/promote", cookies=infer, data=form).status_code == 403
    assert httpx.post(f"{page_url}/promote", cookies=admin,
                      data={"release_id": held.release_id, "csrf": csrf}).status_code == 400
    # promoting a release that is not held is a conflict, and changes nothing
    assert httpx.post(f"{page_url}/promote", cookies=admin,
                      data={"release_id": a.release_id, "confirm": "yes", "csrf": csrf}).status_code == 409
    done = httpx.post(f"{page_url}/promote", cookies=admin, data=form)
    assert done.status_code == 303 and done.headers["location"] == "/ui/scenarios/rel"
    rows = httpx.get(f"{server.url}/reef/scenarios/rel/releases", headers=INFER).json()["releases"]
    assert rows[0]["current"] and rows[0]["operation"] == "promote" and rows[0]["content_id"] == held.content_id


CRASHER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from reef_core.commit.commitlog import CommitLog
    from reef_core.commit.committer import Committer
    from reef_core.commit.git_store import GitArtifactStore
    data = Path(sys.argv[1])
    store = GitArtifactStore(data / "artifacts.git", data / "artifacts-work")
    c = Committer(store, CommitLog.for_scenario(data / "commits", "rel"), "rel")
    head = store.head("rel")
    c.publish({"prompt.md": sys.argv[2].encode()}, expected_head=head.release_id if head else None,
              consumed_ids=[sys.argv[2]])
    print("published without crashing")
""")


@pytest.mark.parametrize("point, moved", [("after_stage", False), ("after_log", True), ("after_head", True)])
def test_crash_in_each_gap_recovers(data_dir, reef_server, fake_upstream_url, point, moved):
    first = subprocess.run([sys.executable, "-c", CRASHER, str(data_dir), "first"], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    crashed = subprocess.run([sys.executable, "-c", CRASHER, str(data_dir), "second"], capture_output=True,
                             text=True, env={**os.environ, "REEF_CRASH_AT": point})
    assert crashed.returncode == 137 and "without crashing" not in crashed.stdout

    server = reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}", *_tokens(),
                         data_dir=data_dir)
    url = f"{server.url}/reef/scenarios/rel"
    status = httpx.get(f"{url}/status", headers=INFER).json()
    commits = httpx.get(f"{url}/commits", headers=INFER).json()["commits"]
    releases = httpx.get(f"{url}/releases", headers=INFER).json()["releases"]
    head = next(r for r in releases if r["current"])
    # Head, commit log and consumed ids agree.
    assert status["current_release_id"] == head["release_id"] == commits[-1]["release_id"]
    consumed = {i for row in commits for i in row["consumed_ids"]}
    if moved:
        assert len(commits) == 2 and consumed == {"first", "second"}
        assert GitArtifactStore(data_dir / "artifacts.git", data_dir / "artifacts-work").read_files(
            head["release_id"])["prompt.md"] == b"second"
    else:
        assert len(commits) == 1 and consumed == {"first"}
    assert len([r for r in releases if not r["pending"]]) == len(commits)
    chat(server, "rel")  # serving works
