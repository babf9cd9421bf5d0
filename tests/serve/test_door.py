"""The door: scenario names and client ids are checked before anything is written, refused requests create
nothing, and no request (nor one scenario's bad data) can stop the server from starting again."""

from __future__ import annotations

import hashlib
import sqlite3
import time
from urllib.parse import quote

import httpx
import pytest

from reef_core.commit.commitlog import CommitLog
from reef_core.errors import ValidationFailed
from reef_core.names import MAX_SCENARIO_BYTES, check_record_id, check_scenario_name
from reef_core.testing.fake_upstream import FakeUpstreamControl
from reef_core.testing.fixtures import wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

#: Accepted names: 1..max bytes, multi-byte UTF-8, spaces, dots, names differing only in case.
GOOD_NAMES = ["a", "x" * 190, "y" * MAX_SCENARIO_BYTES, "é" * (MAX_SCENARIO_BYTES // 2), "数学" * 33,
              "with spaces", "a..b", ".hidden", "Case", "case", "emoji 🦀", "back\\slash", "50%", "q?x#y"]
#: Refused names (as text) and why.
BAD_NAMES = ["", "z" * (MAX_SCENARIO_BYTES + 1), "é" * (MAX_SCENARIO_BYTES // 2 + 1), "tab\there", "cr\rx",
             "lf\nx", "nul\x00x", "del\x7fx", "sep\u2028x", "a/b", ".", "..", " lead", "trail "]


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_scenario_rule_accepts(name):
    assert check_scenario_name(name) == name


@pytest.mark.parametrize("name", BAD_NAMES)
def test_scenario_rule_refuses(name):
    with pytest.raises(ValidationFailed):
        check_scenario_name(name)


@pytest.mark.parametrize("value", ["a\r\nb", "é", "a/b", "", "x" * 129, ".", "..", "-a", "a b", 5, None])
def test_id_grammar_refuses(value):
    with pytest.raises(ValidationFailed):
        check_record_id(value, "agent_record_id")


def test_commit_log_for_every_accepted_name(tmp_path):
    # File names are digests: a 200-byte name fits, names differing only in case stay apart.
    paths = set()
    for name in GOOD_NAMES:
        log = CommitLog.for_scenario(tmp_path, name)
        try:
            log.append({"operation": "training", "consumed_ids": ["r1"]}, expected_step=0)
        finally:
            log.close()
        paths.add(log.path.name.lower())
        assert len(log.path.name) == 64 + len(".jsonl")
    assert len(paths) == len(GOOD_NAMES)


def test_commit_log_keeps_reading_a_legacy_file(tmp_path):
    import base64

    legacy = tmp_path / f"{base64.urlsafe_b64encode(b'old').decode()}.jsonl"
    log = CommitLog(legacy)
    log.append({"operation": "training"}, expected_step=0)
    log.close()
    again = CommitLog.for_scenario(tmp_path, "old")
    try:
        assert again.path == legacy and again.last_step() == 1
    finally:
        again.close()


def test_git_refs_for_every_accepted_name_and_legacy_refs(tmp_path):
    import base64

    from reef_core.commit.git_store import GitArtifactStore
    from reef_core.testing.chain import publish

    store = GitArtifactStore(tmp_path / "repo.git", tmp_path / "work")
    for name in GOOD_NAMES:
        release = publish(store, name, {"p.md": name.encode()}, expected_parent=None, operation="creation")
        assert store.head(name).release_id == release.release_id
    assert store.scenarios() == sorted(GOOD_NAMES)
    store.archive("Case")
    assert [row["scenario"] for row in store.archived()] == ["Case"]
    assert store.head("case") is not None and store.head("Case") is None
    # A repository written by earlier versions (refs keyed by base64 of the name) is renamed when opened.
    head = store.head("case").release_id
    legacy = "refs/reef/scenarios/" + base64.urlsafe_b64encode(b"case").decode()
    store.git.run("update-ref", "-d", f"refs/reef/scenarios/{hashlib.sha256(b'case').hexdigest()}")
    store.git.run("update-ref", legacy, head)
    reopened = GitArtifactStore(tmp_path / "repo.git", tmp_path / "work")
    assert reopened.head("case").release_id == head
    assert legacy not in reopened._snapshot()


# -- over HTTP -----------------------------------------------------------------------------------------------


@pytest.fixture
def server(reef_server, fake_upstream_url):
    return reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}")


def chat(server, scenario, *, headers=None, json=CHAT, content=None):
    hdrs = {"x-reef-scenario": scenario, **(headers or {})}
    if content is not None:
        return httpx.post(f"{server.url}/v1/chat/completions", headers=hdrs, content=content, timeout=30)
    return httpx.post(f"{server.url}/v1/chat/completions", headers=hdrs, json=json, timeout=30)


def report(server, scenario, body):
    return httpx.post(f"{server.url}/reef/report", headers={"x-reef-scenario": scenario}, json=body, timeout=30)


def scenario_names(server) -> set[str]:
    return {row["scenario"] for row in httpx.get(f"{server.url}/reef/scenarios", timeout=30).json()["scenarios"]}


def records(server, scenario) -> list[dict]:
    response = httpx.get(f"{server.url}/reef/scenarios/{quote(scenario, safe='')}/records", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["records"]


def commit_logs(server) -> set[str]:
    root = server.data_dir / "commits"
    return {p.name for p in root.iterdir()} if root.exists() else set()


def learners(server) -> set[str]:
    return set(httpx.get(f"{server.url}/reef/status", timeout=30).json()["scenarios"])


def refused_requests(server, upstream: FakeUpstreamControl) -> list[tuple[str, httpx.Response]]:
    """Send one of each refused request, each to its own new scenario; return ``(scenario, response)``."""
    sent = []
    sent.append(("bad-tag", chat(server, "bad-tag", headers={"x-reef-tag-t": "v" * 600})))
    sent.append(("bad-receipt", chat(server, "bad-receipt", headers={"x-reef-agent-record-id": "a/b"})))
    sent.append(("bad-key", chat(server, "bad-key", headers={"idempotency-key": "k y"})))
    sent.append(("bad-body", chat(server, "bad-body", content=b"{not json")))
    sent.append(("bad-ref", report(server, "bad-ref", {"score": 1, "references": ["no-such-receipt"]})))
    sent.append(("bad-report-id", report(server, "bad-report-id", {"score": 1, "agent_record_id": "a\r\nb"})))
    upstream.faults({"status": 429, "retry_after": "1"})
    sent.append(("relayed-error", chat(server, "relayed-error")))
    return sent


def test_refused_requests_create_no_scenario_log_or_learner(server, fake_upstream_url):
    assert chat(server, "existing").status_code == 200
    wait_until(lambda: "existing" in learners(server), timeout=60)
    logs, running = commit_logs(server), learners(server)
    for scenario, response in refused_requests(server, FakeUpstreamControl(fake_upstream_url)):
        assert 400 <= response.status_code < 500, (scenario, response.text)
        assert scenario not in scenario_names(server), scenario
    assert commit_logs(server) == logs
    assert learners(server) == running
    # The first stored record creates the scenario (and only then its learner and log).
    assert chat(server, "bad-tag").status_code == 200
    assert "bad-tag" in scenario_names(server)
    wait_until(lambda: "bad-tag" in learners(server), timeout=60)  # started once the record is durable


@pytest.mark.parametrize("bad_id", ["a\r\nb", "é", "a/b", "a b"])
def test_report_ids_outside_the_grammar_are_400_and_store_nothing(server, bad_id):
    receipt = chat(server, "reports").headers["x-reef-agent-record-id"]
    before = len(records(server, "reports"))
    for body in ({"score": 1, "agent_record_id": bad_id}, {"score": 1, "references": [receipt, bad_id]}):
        response = report(server, "reports", body)
        assert response.status_code == 400, response.text
    assert len(records(server, "reports")) == before
    # The same grammar at the path: an id no row holds and the grammar refuses is a 400, not a 404.
    path_id = httpx.get(f"{server.url}/reef/scenarios/reports/records/{quote(bad_id, safe='')}", timeout=30)
    assert path_id.status_code in (400, 404) and (path_id.status_code == 400) == ("/" not in bad_id)


def test_header_names_are_utf8_and_bad_names_are_400(server):
    response = chat(server, "café".encode())  # raw UTF-8 bytes on the wire
    assert response.status_code == 200, response.text
    assert "café" in scenario_names(server)
    for raw in (b"\xff\xfe", b"tab\there", b"a/b", b"..", "z".encode() * (MAX_SCENARIO_BYTES + 1)):
        response = chat(server, raw)
        assert response.status_code == 400 and "x-reef-scenario" in response.text, (raw, response.text)
    assert scenario_names(server) == {"café"}
    # A path name the rule refuses and no row holds is a 400; a valid unknown one a 404.
    assert httpx.get(f"{server.url}/reef/scenarios/tab%09x/status", timeout=30).status_code == 400
    assert httpx.get(f"{server.url}/reef/scenarios/unknown/status", timeout=30).status_code == 404


def test_restart_after_bad_names_and_refused_requests(server, fake_upstream_url):
    good = [n for n in GOOD_NAMES if n != "a"]  # every accepted shape, long and odd ones included
    for name in good:
        response = chat(server, name.encode())
        assert response.status_code == 200, (name, response.text)
    for raw in (b"tab\there", b"\xff", b"a/b", b"z" * 201):
        assert chat(server, raw).status_code == 400
    refused = [scenario for scenario, _ in refused_requests(server, FakeUpstreamControl(fake_upstream_url))]
    server.restart()
    assert chat(server, "after-restart").status_code == 200
    names = scenario_names(server)
    assert names == {*good, "after-restart"}
    assert not names & set(refused)
    for name in good:
        assert len(records(server, name)) == 1, name
    assert httpx.get(f"{server.url}/reef/status", timeout=30).json()["quarantined"] == {}


def test_bad_scenario_data_is_quarantined_and_start_up_goes_on(server):
    assert chat(server, "good").status_code == 200
    server.stop()
    db = sqlite3.connect(server.data_dir / "records.db")
    recipe = db.execute("SELECT recipe FROM scenarios WHERE name = 'good'").fetchone()[0]
    with db:  # a name stored by older code (TAB), and a scenario whose commit log is damaged
        db.execute("INSERT INTO scenarios VALUES (?, ?, ?, 0)", ("old\tname", recipe, time.time()))
        db.execute("INSERT INTO scenarios VALUES (?, ?, ?, 0)", ("broken", recipe, time.time()))
    db.close()
    (server.data_dir / "commits").mkdir(exist_ok=True)
    damaged = server.data_dir / "commits" / f"{hashlib.sha256(b'broken').hexdigest()}.jsonl"
    damaged.write_bytes(b"not json\n{\"step\": 2}\n")
    server.start()
    status = httpx.get(f"{server.url}/reef/status", timeout=30).json()
    assert "corrupt" in status["quarantined"]["broken"]
    broken = chat(server, "broken")
    assert broken.status_code == 503 and "quarantined" in broken.text
    assert chat(server, "good").status_code == 200
    scenario_status = httpx.get(f"{server.url}/reef/scenarios/broken/status", timeout=30).json()
    assert "corrupt" in scenario_status["quarantined"]
    # The old name is still addressable by path, and both can be archived by an admin.
    old = quote("old\tname", safe="")
    assert httpx.get(f"{server.url}/reef/scenarios/{old}/status", timeout=30).status_code == 200
    for path in (old, "broken"):
        response = httpx.delete(f"{server.url}/reef/scenarios/{path}", timeout=30)
        assert response.status_code == 200, response.text
    assert httpx.get(f"{server.url}/reef/status", timeout=30).json()["quarantined"] == {}
    server.restart()
    assert chat(server, "good").status_code == 200
