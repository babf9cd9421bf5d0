"""#37 D5: record ids are scoped per scenario in the store, so a scoped token learns nothing of another team's ids.

Two tokens, each confined to its team's scenarios. A report quoting the other team's receipt gets the very 400 of
an unknown reference (not a 403); reusing an id the other team holds (as ``x-reef-agent-record-id``, a report's or
an import's ``agent_record_id``) is answered exactly as a free id is: 200, the receipt the id itself. Neither team
can claim an id first and lock the other out, and within a scenario an id still names one record (409 on reuse).
"""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from reef_core.config import compose_config
from reef_core.loop.assemble import build_deployment
from reef_core.serve.app import create_app

ADMIN, TEAM_A, TEAM_B = "ids-admin", "ids-team-a", "ids-team-b"
SCOPED = ("server.scoped_tokens=["
          f"{{name:team-a,token:{TEAM_A},scenarios:['team-a-*']}},"
          f"{{name:team-b,token:{TEAM_B},scenarios:['team-b-*']}}]")


def chat(text: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


def auth(token: str, scenario: str, record_id: str | None = None) -> dict:
    headers = {"authorization": f"Bearer {token}", "x-reef-scenario": scenario}
    if record_id:
        headers["x-reef-agent-record-id"] = record_id
    return headers


@pytest.fixture
def served(tmp_path, fake_upstream_url):
    cfg = compose_config(["engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                          f"storage.data_dir={tmp_path}/data", f"server.admin_tokens=[{ADMIN}]", SCOPED])
    with TestClient(create_app(build_deployment(cfg))) as client:
        yield client


def records(client, scenario: str) -> list[dict]:
    answer = client.get(f"/reef/scenarios/{scenario}/records", headers={"authorization": f"Bearer {ADMIN}"})
    assert answer.status_code == 200, answer.text
    return answer.json()["records"]


def test_a_report_quoting_another_teams_receipt_is_answered_as_an_unknown_one(served):
    b = served.post("/v1/chat/completions", json=chat("b's question"), headers=auth(TEAM_B, "team-b-x", "b-1"))
    assert b.status_code == 200 and b.headers["x-reef-agent-record-id"] == "b-1"
    answers = {}
    for ref in ("b-1", "never-stored"):
        answer = served.post("/reef/report", json={"score": 1, "references": [ref]}, headers=auth(TEAM_A, "team-a-x"))
        answers[ref] = (answer.status_code, answer.text.replace(ref, "ID"))
        # The same through the record import.
        envelope = {"agent_record_id": f"rpt-{ref}", "request_type": "report",
                    "payload": {"score": 1, "references": [ref]}}
        imported = served.post("/reef/records", json=envelope, headers=auth(TEAM_A, "team-a-x"))
        answers[ref, "import"] = (imported.status_code, imported.text.replace(ref, "ID"))
    assert answers["b-1"] == answers["never-stored"] and answers["b-1"][0] == 400, answers
    assert answers["b-1", "import"] == answers["never-stored", "import"] and answers["b-1", "import"][0] == 400
    created = served.get("/reef/scenarios/team-a-x/records", headers={"authorization": f"Bearer {ADMIN}"})
    assert created.status_code == 404  # nothing stored, nothing created


def test_reusing_another_teams_id_is_answered_as_a_free_one_and_locks_nobody_out(served):
    b = served.post("/v1/chat/completions", json=chat("b's question"), headers=auth(TEAM_B, "team-b-x", "shared"))
    assert b.status_code == 200 and b.headers["x-reef-agent-record-id"] == "shared"
    for rid in ("shared-r", "shared-i"):
        stored = served.post("/v1/chat/completions", json=chat(rid), headers=auth(TEAM_B, "team-b-x", rid))
        assert stored.status_code == 200
    b_records = records(served, "team-b-x")

    def as_a(rid: str | None, text: str):
        return served.post("/v1/chat/completions", json=chat(text), headers=auth(TEAM_A, "team-a-x", rid))

    # Team A reuses B's id, and a free one: the two answers differ in nothing but the id (it was a 409, then a
    # receipt other than the id).
    taken, free = as_a("shared", "a's question"), as_a("never-used", "a's question")
    assert taken.status_code == free.status_code == 200, taken.text
    assert taken.headers["x-reef-agent-record-id"] == "shared" and "x-reef-replayed" not in taken.headers
    assert free.headers["x-reef-agent-record-id"] == "never-used"
    # Its retry with the same id finds its own record (idempotent), never B's.
    again = as_a("shared", "a's question")
    assert again.status_code == 200 and again.headers["x-reef-agent-record-id"] == "shared"
    assert again.headers.get("x-reef-replayed") == "true"
    # A claims an id first; B is not locked out of it.
    first = as_a("a-first", "a first")
    assert first.status_code == 200 and first.headers["x-reef-agent-record-id"] == "a-first"
    late = served.post("/v1/chat/completions", json=chat("b later"), headers=auth(TEAM_B, "team-b-x", "a-first"))
    assert late.status_code == 200 and late.headers["x-reef-agent-record-id"] == "a-first"
    # A report's and an import's own id: the same rule.
    report = served.post("/reef/report", json={"score": 1, "references": ["shared"], "agent_record_id": "shared-r"},
                         headers=auth(TEAM_A, "team-a-x"))
    assert report.status_code == 200 and report.json()["agent_record_id"] == "shared-r", report.text
    # Within the scenario an id names one record: reused for another, a 409.
    assert served.post("/reef/report", json={"score": 1, "references": ["shared"], "agent_record_id": "shared"},
                       headers=auth(TEAM_A, "team-a-x")).status_code == 409
    assert as_a("shared", "another question").status_code == 409
    envelope = {"agent_record_id": "shared-i", "request_type": "inference",
                "payload": {"request": chat("imported"), "response": {
                    "choices": [{"message": {"role": "assistant", "content": "ok"}}]}}}
    imported = served.post("/reef/records/batch", json={"records": [envelope, {
        "agent_record_id": "rpt-imported", "request_type": "report",
        "payload": {"score": 1, "references": ["shared-i"]}}]}, headers=auth(TEAM_A, "team-a-x"))
    assert imported.status_code == 200, imported.text
    stored = imported.json()["records"]
    assert stored[0] == {"agent_record_id": "shared-i", "scenario": "team-a-x", "request_type": "inference"}
    quoted = served.get("/reef/scenarios/team-a-x/records/rpt-imported", headers=auth(TEAM_A, "team-a-x")).json()
    assert quoted["references"] == ["shared-i"]  # the batch's report quotes the batch's own record
    # B's records are untouched, and B still replays its own "shared".
    assert records(served, "team-b-x")[:len(b_records)] == b_records
    replay = served.post("/v1/chat/completions", json=chat("b's question"), headers=auth(TEAM_B, "team-b-x", "shared"))
    assert replay.status_code == 200 and replay.headers.get("x-reef-replayed") == "true"
    # Each scenario reads its own record under the id.
    mine = served.get("/reef/scenarios/team-a-x/records/shared", headers=auth(TEAM_A, "team-a-x")).json()
    theirs = served.get("/reef/scenarios/team-b-x/records/shared", headers=auth(TEAM_B, "team-b-x")).json()
    assert mine["payload"]["request"]["messages"][0]["content"] == "a's question"
    assert theirs["payload"]["request"]["messages"][0]["content"] == "b's question"
