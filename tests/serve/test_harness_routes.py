"""Harness routes over real HTTP (uvicorn + the real app, git store and harness surface).

The deployment is a small stub holding real pieces: a ``GitArtifactStore`` with releases published
the way the learner publishes them, a ``HarnessSurface`` activated on them, and the scenario table.
"""

from __future__ import annotations

import socket
from types import SimpleNamespace
from urllib.parse import urlsplit

import httpx
import pytest

from reef_core.commit.git_store import GitArtifactStore
from reef_core.config.schema import ReefConfig
from reef_core.observe.model import Scenario
from reef_core.serve.app import create_app
from reef_core.surfaces.harness import HarnessSurface
from reef_core.testing.fake_upstream import serve_asgi
from reef_core.testing.chain import publish

SECRET = "TOP-SECRET-DO-NOT-SERVE"
H = {"x-reef-scenario": "harn"}


class RecordingStore:
    """Delegates to a GitArtifactStore and counts every read, to prove refused requests read nothing."""

    READS = ("get", "head", "read_files", "releases", "materialize")

    def __init__(self, store: GitArtifactStore):
        self.inner = store
        self.reads = 0

    def __getattr__(self, name):
        value = getattr(self.inner, name)
        if name in self.READS:
            def counted(*args, **kwargs):
                self.reads += 1
                return value(*args, **kwargs)
            return counted
        return value


class _Scenarios:
    def __init__(self, rows: dict[str, Scenario]):
        self.rows = rows

    def get_scenario(self, name: str):
        return self.rows.get(name)

    def close(self):
        pass


class HarnessRouteDeployment:
    """Deployment-like stub: exactly what ``create_app`` and the harness routes use."""

    def __init__(self, tmp_path):
        self.cfg = ReefConfig()
        self.artifacts = RecordingStore(GitArtifactStore(tmp_path / "artifacts.git", tmp_path / "work"))
        self.engine = SimpleNamespace(model_ids=lambda: ["m"])
        self.store = _Scenarios({name: Scenario(name, recipe, 0.0) for name, recipe in
                                 [("harn", "gepa"), ("other", "gepa"), ("empty", "gepa"), ("plain", "none")]})
        self.store.rows["gone"] = Scenario("gone", "gepa", 0.0, archived=True)
        self.harness = HarnessSurface(self.artifacts, {"inject": "system"})

    @property
    def server(self):
        return self.cfg.server

    def surface_for(self, scenario):
        return self.harness if scenario.recipe == "gepa" else None

    def find_scenario(self, name):
        return self.store.get_scenario(name)

    def find_release(self, release_id):
        return self.artifacts.get(release_id)

    def release_files(self, release_id):
        return self.artifacts.read_files(release_id)

    def release_rows(self, scenario):
        head = self.artifacts.head(scenario)
        return [{**release.to_dict(), "current": head is not None and release.release_id == head.release_id}
                for release in self.artifacts.releases(scenario)]

    def model_ids(self):
        return self.engine.model_ids()

    def learners(self):
        return {}

    def writer_stats(self):
        return None

    def plugin_failures(self):
        return {}

    def extra_routers(self):
        from reef_core.serve.routes import harness

        return [harness.router]

    async def start(self):
        pass

    async def stop(self):
        pass

    def publish(self, scenario, files, parent=None, evaluation=None):
        release = publish(self.artifacts.inner, scenario, files, expected_parent=parent,
                                               metrics={"val_mean": len(files)}, evaluation=evaluation)
        self.harness.activate(scenario, release.release_id, files=lambda: self.artifacts.inner.read_files(
            release.release_id))
        return release


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("harness-routes")
    (tmp / "secret.txt").write_text(SECRET)
    (tmp / "work" / "releases").mkdir(parents=True)
    (tmp / "work" / "releases" / "secret.txt").write_text(SECRET)
    dep = HarnessRouteDeployment(tmp)
    first = dep.publish("harn", {"system_prompt.md": b"First prompt.", "skills/a/SKILL.md": b"Skill A."})
    second = dep.publish("harn", {"system_prompt.md": "Second prompt é.".encode(), "skills/a/SKILL.md": b"Skill A."},
                         parent=first.release_id, evaluation={"decision": "select", "scores": [1.0]})
    foreign = dep.publish("other", {"system_prompt.md": b"Other scenario."})
    with serve_asgi(create_app(dep)) as url:
        yield SimpleNamespace(url=url, dep=dep, first=first, second=second, foreign=foreign, tmp=tmp)


def get(env, route, headers=H, **params):
    return httpx.get(f"{env.url}{route}", headers=headers, params=params or None)


def test_current_harness_with_release_header(env):
    response = get(env, "/reef/harness")
    assert response.status_code == 200, response.text
    body = response.json()
    assert response.headers["x-reef-release-id"] == env.second.release_id == body["release_id"]
    assert body["files"] == {"skills/a/SKILL.md": "Skill A.", "system_prompt.md": "Second prompt é."}
    assert body["content_id"] == env.second.content_id
    assert body["parent_release_id"] == env.first.release_id
    assert body["evaluation"] == body["gate"] == {"decision": "select", "scores": [1.0]}
    one = get(env, "/reef/harness", path="skills/a/SKILL.md").json()
    assert one["files"] == {"skills/a/SKILL.md": "Skill A."}


def test_earlier_release_by_id_or_version_alias(env):
    rid = env.first.release_id
    for params in ({"release_id": rid}, {"version": rid}, {"release_id": f"git+lfs://{rid}"}):
        response = get(env, "/reef/harness", **params)
        assert response.status_code == 200, response.text
        assert response.headers["x-reef-release-id"] == rid
        assert response.json()["files"]["system_prompt.md"] == "First prompt."
        assert response.json()["parent_release_id"] is None
    assert get(env, "/reef/harness", release_id=rid, version=env.second.release_id).status_code == 400
    text = get(env, "/reef/harness/files/system_prompt.md", release_id=rid)
    assert text.status_code == 200 and text.text == "First prompt."
    assert text.headers["x-reef-release-id"] == rid


@pytest.mark.parametrize("params", [{"release_id": "0" * 40}, {"release_id": "not-a-sha"}, {"version": "HEAD"},
                                    {"release_id": "../../etc/passwd"}])
def test_unknown_release_is_404(env, params):
    assert get(env, "/reef/harness", **params).status_code == 404


def test_release_of_another_scenario_is_404(env):
    assert get(env, "/reef/harness", release_id=env.foreign.release_id).status_code == 404


def test_not_restorable_release_is_404(tmp_path):
    dep = HarnessRouteDeployment(tmp_path)
    # *.bin is routed to git-lfs; marking the release pruned makes it unrestorable.
    weights = dep.publish("harn", {"system_prompt.md": b"p", "notes.bin": b"text kept in lfs"})
    later = dep.publish("harn", {"system_prompt.md": b"q"}, parent=weights.release_id)
    dep.artifacts.inner.mark_pruned([weights.release_id])
    with serve_asgi(create_app(dep)) as url:
        response = httpx.get(f"{url}/reef/harness", headers=H, params={"release_id": weights.release_id})
        assert response.status_code == 404
        assert "not restorable" in response.json()["error"]["message"]
        assert httpx.get(f"{url}/reef/harness", headers=H).json()["release_id"] == later.release_id


def test_missing_header_unknown_scenario_and_no_harness(env):
    assert get(env, "/reef/harness", headers={}).status_code == 400
    assert get(env, "/reef/harness", headers={"x-reef-scenario": ""}).status_code == 400
    for scenario in ("nope", "gone", "plain", "empty"):
        response = get(env, "/reef/harness", headers={"x-reef-scenario": scenario})
        assert response.status_code == 404, scenario
        response = get(env, "/reef/harness/releases", headers={"x-reef-scenario": scenario})
        assert response.status_code == (200 if scenario == "empty" else 404), scenario
    assert "nope" not in env.dep.store.rows  # reads never create a scenario


def test_releases_oldest_first_with_metrics(env):
    response = get(env, "/reef/harness/releases")
    assert response.status_code == 200
    body = response.json()
    assert body["scenario"] == "harn"
    rows = body["releases"]
    assert [r["release_id"] for r in rows] == [env.first.release_id, env.second.release_id]
    assert [r["step"] for r in rows] == [0, 1]
    assert [r["current"] for r in rows] == [False, True]
    assert rows[0]["metrics"] == {"val_mean": 2} and rows[1]["parent_release_id"] == env.first.release_id
    assert get(env, "/reef/harness/releases", headers={"x-reef-scenario": "empty"}).json()["releases"] == []


def test_single_file_route(env):
    response = get(env, "/reef/harness/files/skills/a/SKILL.md")
    assert response.status_code == 200 and response.text == "Skill A."
    assert response.headers["content-type"].startswith("text/plain")
    assert get(env, "/reef/harness/files/skills/b/SKILL.md").status_code == 404


# Every form a traversal can take on the wire; each must be refused with 400 before any read.
ENCODED_FILE_PATHS = [
    "%2e%2e/secret.txt", "..%2fsecret.txt", "%2e%2e%2fsecret.txt", "..%2f..%2fsecret.txt",
    "%2e%2e%2f%2e%2e%2fsecret.txt", "skills/%2e%2e/%2e%2e/secret.txt", "..%5csecret.txt", "%5c..%5csecret.txt",
    "%2fetc%2fpasswd", "%252e%252e%252fsecret.txt", "a/%00/b", "C:%5cwindows%5cwin.ini", ".git/config",
    "%2egit/HEAD", "skills//SKILL.md", "reef-artifact.json",
]
RAW_FILE_PATHS = ["../secret.txt", "../../secret.txt", "skills/../../secret.txt", "./system_prompt.md",
                  "..\\secret.txt", "/etc/passwd"]
QUERY_PATHS = ["../secret.txt", "/etc/passwd", "%2e%2e/secret.txt", "..\\secret.txt", "a/../system_prompt.md",
               "skills/a/../../../secret.txt"]


def _raw_get(url: str, target: str) -> tuple[int, str]:
    """Send a request line exactly as written (no client-side normalisation of dot segments)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: test\r\nx-reef-scenario: harn\r\nConnection: close\r\n\r\n"
                     .encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode(errors="replace")


def test_path_traversal_is_refused_and_reads_nothing(env):
    reads_before = env.dep.artifacts.reads
    for path in ENCODED_FILE_PATHS:
        response = httpx.get(f"{env.url}/reef/harness/files/{path}", headers=H)
        assert response.status_code == 400, (path, response.status_code, response.text)
        assert SECRET not in response.text
    for path in RAW_FILE_PATHS:
        status, body = _raw_get(env.url, f"/reef/harness/files/{path}")
        assert status == 400, (path, status, body)
        assert SECRET not in body
    for path in QUERY_PATHS:
        response = get(env, "/reef/harness", path=path)
        assert response.status_code == 400, (path, response.text)
        assert SECRET not in response.text
    status, body = _raw_get(env.url, "/reef/harness?path=../secret.txt")
    assert status == 400 and SECRET not in body
    assert env.dep.artifacts.reads == reads_before  # refused before the artifact store was touched
