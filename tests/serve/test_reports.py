"""POST /reef/report over real HTTP: validation, references, retry safety, typed schemas."""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def server(module_reef_server, fake_upstream_url, store_overrides):
    return module_reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}", *store_overrides)


def infer(server, scenario, text):
    response = httpx.post(f"{server.url}/v1/chat/completions", headers={"x-reef-scenario": scenario},
                          json={"model": "m", "messages": [{"role": "user", "content": text}]})
    assert response.status_code == 200, response.text
    return response.headers["x-reef-agent-record-id"]


def report(server, scenario, body):
    return httpx.post(f"{server.url}/reef/report", headers={"x-reef-scenario": scenario}, json=body)


def records(server, scenario):
    return httpx.get(f"{server.url}/reef/scenarios/{scenario}/records").json()["records"]


def test_report_stored_with_references_and_receipt(server):
    receipts = [infer(server, "math", f"q{i}") for i in range(3)]
    response = report(server, "math", {"score": 0.5, "feedback": {"note": "ok"}, "references": receipts,
                                       "metadata": {"task": "t1"}})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["request_type"] == "report" and body["scenario"] == "math"
    assert response.headers["x-reef-agent-record-id"] == body["agent_record_id"]
    rows = records(server, "math")
    assert rows[-1]["agent_record_id"] == body["agent_record_id"]
    assert rows[-1]["references"] == receipts and rows[-1]["score"] == 0.5
    detail = httpx.get(f"{server.url}/reef/scenarios/math/records/{body['agent_record_id']}").json()
    assert detail["payload"] == {"score": 0.5, "feedback": {"note": "ok"}, "metadata": {"task": "t1"}}


def test_bad_references_are_400_and_store_nothing(server):
    mine = infer(server, "refs", "mine")
    foreign = infer(server, "other", "theirs")
    before = len(records(server, "refs"))
    for refs, needle in (([mine, "no-such-receipt"], "no-such-receipt"), ([foreign], foreign),
                         ([mine, mine], "duplicate")):
        response = report(server, "refs", {"score": 1, "references": refs})
        assert response.status_code == 400, refs
        assert needle in response.json()["error"]["message"]
    first_report = report(server, "refs", {"score": 1, "references": [mine]}).json()["agent_record_id"]
    response = report(server, "refs", {"score": 1, "references": [first_report]})
    assert response.status_code == 400  # a report is not an inference record
    assert len(records(server, "refs")) == before + 1


@pytest.mark.parametrize("body, needle", [
    ({"score": True}, "finite number"),
    ({"score": "1"}, "finite number"),
    ({"bogus": 1}, "unknown report field"),
    ({"feedback": 3}, "feedback"),
    ({"feedback": "x" * 70000}, "larger than"),
    ({"references": [f"r{i}" for i in range(101)]}, "at most 100"),
    ({"metadata": {"training": {"eligible": True}}}, "eligible"),
    ({"metadata": [1]}, "metadata"),
    ({"score": 0.0, "metadata": {"unscored": True}}, "score null"),  # the sentinel never carries a fake number
    ({"score": -1.0, "metadata": {"unscored": True}}, "score null"),
    ({"metadata": {"unscored": "yes"}}, "unscored must be"),
])
def test_report_validation(server, body, needle):
    response = report(server, "validation", body)
    assert response.status_code == 400
    assert needle in response.json()["error"]["message"]


def test_non_finite_score_refused(server):
    response = httpx.post(f"{server.url}/reef/report", headers={"x-reef-scenario": "validation",
                                                                "content-type": "application/json"},
                          content=b'{"score": NaN}')
    assert response.status_code == 400


def test_client_id_makes_reports_retry_safe(server):
    receipt = infer(server, "retry", "q")
    body = {"score": 1.0, "references": [receipt], "agent_record_id": "report-7"}
    first = report(server, "retry", body)
    again = report(server, "retry", body)
    assert first.status_code == again.status_code == 200
    assert first.json()["agent_record_id"] == again.json()["agent_record_id"] == "report-7"
    assert sum(r["request_type"] == "report" for r in records(server, "retry")) == 1
    conflict = report(server, "retry", {**body, "score": 0.0})
    assert conflict.status_code == 409


def test_typed_report_schema_of_a_third_party_recipe(reef_server, fake_upstream_url):
    server = reef_server("+recipe=thumbs", "engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}")
    receipt = infer(server, "votes", "hello")
    bad = report(server, "votes", {"feedback": "meh", "references": [receipt]})
    assert bad.status_code == 400 and "'up' or 'down'" in bad.json()["error"]["message"]
    good = report(server, "votes", {"feedback": "up", "references": [receipt]})
    assert good.status_code == 200
    scenarios = httpx.get(f"{server.url}/reef/scenarios").json()["scenarios"]
    assert scenarios[0]["recipe"] == "thumbs"


def test_routes_bind_scenarios_to_several_recipes(reef_server, fake_upstream_url):
    server = reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                         "routes=[{pattern:'votes-*',recipe:thumbs}]")
    voted = infer(server, "votes-a", "hello")
    plain = infer(server, "notes", "hello")
    assert report(server, "votes-a", {"feedback": "meh", "references": [voted]}).status_code == 400
    assert report(server, "votes-a", {"feedback": "up", "references": [voted]}).status_code == 200
    assert report(server, "notes", {"feedback": "meh", "references": [plain]}).status_code == 200
    bound = {s["scenario"]: s["recipe"] for s in httpx.get(f"{server.url}/reef/scenarios").json()["scenarios"]}
    assert bound == {"votes-a": "thumbs", "notes": "none"}
