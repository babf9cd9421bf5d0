"""Tenancy: tokens confined to scenarios and scopes, rate limits and budgets, audit lines.

One in-process app per module (Starlette's TestClient runs its lifespan) in front of the session's fake upstream;
the rate limiter's clock is injected, so "within the minute" and "a minute later" need no sleeping.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
from starlette.testclient import TestClient

from reef_core.config import compose_config
from reef_core.errors import ConfigError
from reef_core.loop.assemble import build_deployment
from reef_core.serve.app import create_app, iter_routes
from reef_core.serve.middleware.auth import TokenSet
from reef_core.errors import RateLimited

ADMIN, TEAM_A, TEAM_A_ADMIN, LIMITED, BUDGET = "admin-tok", "team-a-tok", "team-a-admin-tok", "limited-tok", "budget-tok"
READER = "team-a-reader-tok"
SCOPED = ("server.scoped_tokens=["
          f"{{name:team-a,token:{TEAM_A},scenarios:['team-a-*']}},"
          f"{{name:team-a-admin,token:{TEAM_A_ADMIN},scenarios:['team-a-*'],scopes:[infer,report,read,admin]}},"
          f"{{name:limited,token:{LIMITED},scenarios:['lim-*'],rpm:60}},"
          f"{{name:team-a-reader,token:{READER},scenarios:['team-a-*'],scopes:[read]}},"
          f"{{name:budget,token:{BUDGET},scenarios:['budget-*'],budget_tokens:40,budget_period:total}}]")
#: Routes that name no scenario: they must not show another team's (checked by content, not status).
SCENARIO_LESS = {"/healthz", "/ui/login", "/ui/logout", "/v1/models", "/docs", "/openapi.json", "/metrics",
                 "/reef/scenarios", "/reef/status", "/ui"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


class Clock:
    def __init__(self):
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def _app(data_dir, upstream_url, *overrides: str):
    cfg = compose_config(["engine.kind=upstream", f"engine.upstream_url={upstream_url}", f"storage.data_dir={data_dir}",
                          f"server.admin_tokens=[{ADMIN}]", SCOPED,
                          "server.scenario_limits=[{scenarios:['slow-*'],rpm:2}]", *overrides])
    return create_app(build_deployment(cfg))


@pytest.fixture(scope="module")
def served(tmp_path_factory, fake_upstream_url):
    data_dir = tmp_path_factory.mktemp("tenancy")
    app = _app(data_dir, fake_upstream_url)
    clock = app.state.reef_usage.clock = Clock()
    with TestClient(app) as client:
        for scenario in ("team-a-x", "team-b-x"):
            answer = client.post("/v1/chat/completions", json=CHAT,
                                 headers={"authorization": f"Bearer {ADMIN}", "x-reef-scenario": scenario})
            assert answer.status_code == 200, answer.text
        client.reef_receipt_b = answer.headers["x-reef-agent-record-id"]
        client.reef_clock = clock
        client.reef_data_dir = data_dir
        yield client


def _auth(token: str, scenario: str | None = None) -> dict:
    headers = {"authorization": f"Bearer {token}"}
    if scenario:
        headers["x-reef-scenario"] = scenario
    return headers


def _route_table(app):
    for route in iter_routes(app.routes):
        for method in sorted(route.methods or ()):
            if method != "HEAD":
                yield method, route.path


@pytest.mark.parametrize("token", [TEAM_A, TEAM_A_ADMIN])
def test_every_route_confines_a_scoped_token_to_its_scenarios(served, token):
    table = list(_route_table(served.app))
    assert len(table) >= 30
    checked = 0
    for method, template in table:
        path = re.sub(r"\{scenario\}", "team-b-x", template)
        path = re.sub(r"\{[^}]+\}", "x", path)
        if template in SCENARIO_LESS:
            response = served.request(method, path, headers=_auth(token), json={}, follow_redirects=False)
            assert "team-b" not in response.text, (method, template)
            continue
        response = served.request(method, path, headers=_auth(token, "team-b-x"), json={}, follow_redirects=False)
        # Every other route names a scenario (path or x-reef-scenario): another team's is refused, naming it.
        assert response.status_code in (403, 404), (method, template, response.status_code, response.text)
        assert "team-b-x" in response.text, (method, template, response.text)
        checked += 1
    assert checked >= 20


def test_listings_show_only_the_tokens_scenarios(served):
    listed = served.get("/reef/scenarios", headers=_auth(TEAM_A)).json()["scenarios"]
    assert [s["scenario"] for s in listed] == ["team-a-x"]
    admin_listed = served.get("/reef/scenarios", headers=_auth(ADMIN)).json()["scenarios"]
    assert {"team-a-x", "team-b-x"} <= {s["scenario"] for s in admin_listed}
    status = served.get("/reef/status", headers=_auth(TEAM_A)).json()
    assert "team-b-x" not in json.dumps(status) and "usage" not in status
    page = served.get("/ui", headers=_auth(TEAM_A))
    assert "team-a-x" in page.text and "team-b-x" not in page.text
    assert served.get("/metrics", headers=_auth(TEAM_A)).status_code == 403


def test_scoped_tokens_work_on_their_own_scenarios(served):
    ok = served.post("/v1/messages", json=MESSAGES, headers=_auth(TEAM_A, "team-a-x"))
    assert ok.status_code == 200, ok.text
    receipt = ok.headers["x-reef-agent-record-id"]
    assert served.get(f"/reef/scenarios/team-a-x/records/{receipt}", headers=_auth(TEAM_A)).status_code == 200
    # A record id of another scenario is not found under this one (its existence does not leak).
    other = served.get(f"/reef/scenarios/team-a-x/records/{served.reef_receipt_b}", headers=_auth(TEAM_A))
    assert other.status_code == 404
    # A report quoting another scenario's record stores nothing, and is answered as one quoting an unknown id (#37 D5:
    # a 403 told the token the id exists elsewhere; tests/serve/test_tenancy_ids.py compares the two answers).
    before = served.get("/reef/scenarios/team-a-x/records", headers=_auth(ADMIN)).json()["records"]
    refused = served.post("/reef/report", json={"score": 1, "references": [served.reef_receipt_b]},
                          headers=_auth(TEAM_A, "team-a-x"))
    assert refused.status_code == 400 and "is not a stored record" in refused.json()["error"]["message"]
    envelope = {"agent_record_id": "rpt-cross", "request_type": "report",
                "payload": {"score": 1, "references": [served.reef_receipt_b]}}
    assert served.post("/reef/records", json=envelope, headers=_auth(TEAM_A, "team-a-x")).status_code == 400
    assert served.get("/reef/scenarios/team-a-x/records", headers=_auth(ADMIN)).json()["records"] == before
    assert served.post("/reef/report", json={"score": 1, "references": [receipt]},
                       headers=_auth(TEAM_A, "team-a-x")).status_code == 200
    # Without the admin scope, no rollback even on its own scenario; the scoped admin passes the door there.
    rollback = {"release_id": "nope"}
    assert served.post("/reef/scenarios/team-a-x/rollback", json=rollback, headers=_auth(TEAM_A)).status_code == 403
    assert served.post("/reef/scenarios/team-a-x/rollback", json=rollback,
                       headers=_auth(TEAM_A_ADMIN)).status_code not in (401, 403)
    assert served.post("/reef/scenarios/team-b-x/rollback", json=rollback,
                       headers=_auth(TEAM_A_ADMIN)).status_code == 403


def test_a_read_only_token_reads_but_stores_nothing(served):
    assert served.get("/reef/scenarios/team-a-x/records", headers=_auth(READER)).status_code == 200
    before = served.get("/reef/scenarios/team-a-x/records", headers=_auth(ADMIN)).json()["records"]
    for path, body in (("/v1/chat/completions", CHAT), ("/reef/report", {"score": 1, "references": []}),
                       ("/reef/train", {"instruction": "answer in French"})):
        refused = served.post(path, json=body, headers=_auth(READER, "team-a-x"))
        assert refused.status_code == 403 and "scope" in refused.text, (path, refused.text)
    assert served.get("/reef/scenarios/team-a-x/records", headers=_auth(ADMIN)).json()["records"] == before


def test_refusals_in_each_dialect_name_the_scenario(served):
    openai = served.post("/v1/chat/completions", json=CHAT, headers=_auth(TEAM_A, "team-b-x"))
    assert openai.status_code == 403 and openai.json()["error"]["type"] == "permission_error"
    anthropic = served.post("/v1/messages", json=MESSAGES, headers=_auth(TEAM_A, "team-b-x"))
    assert anthropic.status_code == 403 and anthropic.json()["error"]["type"] == "permission_error"
    assert anthropic.json()["type"] == "error" and "team-b-x" in anthropic.json()["error"]["message"]
    reef = served.get("/reef/scenarios/team-b-x/records", headers=_auth(TEAM_A))
    assert reef.status_code == 403 and reef.json()["error"]["code"] == "forbidden"
    assert "team-b-x" in reef.json()["error"]["message"]


def test_request_61_within_the_minute_is_429_in_both_dialects_and_on_streams(served):
    clock = served.reef_clock
    headers = _auth(LIMITED, "lim-a")
    for _ in range(60):
        assert served.post("/v1/chat/completions", json=CHAT, headers=headers).status_code == 200
    clock.now += 30  # still within the minute of the first request
    openai = served.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert openai.status_code == 429 and openai.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(openai.headers["retry-after"]) <= 30
    anthropic = served.post("/v1/messages", json=MESSAGES, headers=headers)
    assert anthropic.status_code == 429 and anthropic.json()["error"]["type"] == "rate_limit_error"
    assert "retry-after" in anthropic.headers
    with served.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers) as stream:
        assert stream.status_code == 429 and "retry-after" in stream.headers  # refused before the stream starts
    with served.stream("POST", "/v1/messages", json={**MESSAGES, "stream": True}, headers=headers) as stream:
        assert stream.status_code == 429
    clock.now += 31  # the window has moved past the first 60
    assert served.post("/v1/messages", json=MESSAGES, headers=headers).status_code == 200
    # Admins see per-token usage; the limited token's own requests are counted (refused ones are not).
    usage = served.get("/reef/status", headers=_auth(ADMIN)).json()["usage"]
    assert usage["limited"]["requests"] == 61 and usage["limited"]["limits"]["rpm"] == 60


def test_a_scenario_limit_applies_to_every_token(served):
    for token in (ADMIN, ADMIN):
        assert served.post("/v1/chat/completions", json=CHAT, headers=_auth(token, "slow-x")).status_code == 200
    refused = served.post("/v1/messages", json=MESSAGES, headers=_auth(ADMIN, "slow-x"))
    assert refused.status_code == 429 and "scenario 'slow-x'" in refused.json()["error"]["message"]
    assert served.post("/v1/chat/completions", json=CHAT, headers=_auth(ADMIN, "slow-y")).status_code == 200


def test_tokens_per_minute_count_the_engines_usage():
    from reef_core.serve.middleware.usage import Usage

    tenancy = TokenSet.from_config(compose_config(["server.scoped_tokens=[{name:t,token:t,scenarios:['*'],tpm:100}]"]).server)
    principal, clock = tenancy.principal("t"), Clock()
    usage = Usage(tenancy, clock=clock)
    usage.admit(principal, "s")
    usage.spend(principal, "s", 60)
    clock.now += 20
    usage.admit(principal, "s")  # 60 of 100: the pre-check uses what is already spent
    usage.spend(principal, "s", 60)
    with pytest.raises(RateLimited) as info:
        usage.admit(principal, "s")
    assert info.value.details["retry_after"] == 40  # the first 60 tokens leave the window 60 s after they came
    clock.now += 40
    usage.admit(principal, "s")


def test_a_spent_budget_stops_inference_and_survives_a_restart(tmp_path, fake_upstream_url, store_overrides):
    headers = _auth(BUDGET, "budget-a")
    with TestClient(_app(tmp_path, fake_upstream_url, *store_overrides)) as client:
        answered = 0
        while True:
            response = client.post("/v1/chat/completions", json=CHAT, headers=headers)
            if response.status_code == 429:
                break
            assert response.status_code == 200, response.text
            answered += 1
            assert answered < 40, "the budget never stopped inference"
        assert answered >= 1 and "budget" in response.json()["error"]["message"]
        assert "retry-after" not in response.headers  # a total budget does not come back by itself
    # A restart on the same store: the counters were flushed at shutdown and are loaded at start-up.
    with TestClient(_app(tmp_path, fake_upstream_url, *store_overrides)) as client:
        again = client.post("/v1/messages", json=MESSAGES, headers=headers)
        assert again.status_code == 429 and again.json()["error"]["type"] == "rate_limit_error"
        usage = client.get("/reef/status", headers=_auth(ADMIN)).json()["usage"]["budget"]
        assert usage["tokens"] >= 40 and usage["requests"] == answered


def test_scoped_token_config_errors_name_the_field():
    def load(entry: str):
        return TokenSet.from_config(compose_config([f"server.scoped_tokens=[{entry}]"]).server)

    cases = {"{name:a,token:t,scenarios:[x],scopes:[write]}": "scoped_tokens[0].scopes: unknown scope 'write'",
             "{name:a,token:t,scenarios:[]}": "scoped_tokens[0].scenarios",
             "{name:a,scenarios:[x]}": "give exactly one of token",
             "{name:a,token:t,scenarios:[x]},{name:a,token:u,scenarios:[x]}": "scoped_tokens[1].name",
             "{name:a,token:t,scenarios:[x]},{name:b,token:t,scenarios:[x]}": "same token",
             "{name:a,token:t,scenarios:[x],rpm:0}": "scoped_tokens[0].rpm",
             "{name:a,token:t,scenarios:[x],budget_period:week}": "budget_period",
             "{name:a,token_env:REEF_TEST_UNSET_VAR,scenarios:[x]}": "REEF_TEST_UNSET_VAR"}
    for entry, expected in cases.items():
        with pytest.raises(ConfigError) as info:
            load(entry)
        assert expected in info.value.message, (entry, info.value.message)
    sha = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"  # sha256("test")
    tokens = load(f"{{name:a,token_sha256:{sha},scenarios:[x]}}")
    assert tokens.principal("test").name == "a" and tokens.principal("nope") is None


def test_refusals_and_admin_actions_are_audited_without_the_token(served, caplog):
    with caplog.at_level(logging.INFO, logger="reef.audit"):
        served.get("/reef/scenarios/team-b-x/records", headers=_auth(TEAM_A))
        served.get("/reef/scenarios", headers=_auth("wrong-token"))
        served.post("/reef/scenarios/team-a-x/rollback", json={"release_id": "nope"}, headers=_auth(TEAM_A_ADMIN))
    lines = [(r.levelno, r.reef) for r in caplog.records if r.name == "reef.audit"]
    assert any(f["status"] == 403 and f["token"] == "team-a" and f["scenario"] == "team-b-x" for _, f in lines), lines
    assert any(f["status"] == 401 and f["token"] is None for _, f in lines)
    assert any(f["event"] == "admin" and f["token"] == "team-a-admin" and f["scenario"] == "team-a-x"
               for _, f in lines)
    assert not any(TEAM_A in json.dumps(f) or "wrong-token" in json.dumps(f) for _, f in lines)


def test_the_client_sees_only_its_scenarios(served):
    from reef_core.client import Forbidden, ReefClient

    import httpx

    def via_app(request: httpx.Request) -> httpx.Response:  # the in-process app behind the client's HTTP stack
        answer = served.request(request.method, str(request.url), headers=dict(request.headers),
                                content=request.content)
        return httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)

    transport = httpx.MockTransport(via_app)
    with ReefClient("http://testserver", scenario="team-b-x", token=TEAM_A, transport=transport, retries=0) as other:
        with pytest.raises(Forbidden) as info:
            other.records()
        assert info.value.status == 403 and "team-b-x" in info.value.message
    with ReefClient("http://testserver", scenario="team-a-x", token=TEAM_A, transport=transport, retries=0) as own:
        assert own.records()
        assert "team-b-x" not in json.dumps(own.status())


def test_replicas_add_up_their_spending_at_each_flush(tmp_path):
    """Two processes' counters over one store (here two Usage objects on one SQLite store): each flush adds its
    increments and reads the totals back, so a budget both spent halves of is spent for both."""
    import asyncio

    from reef_core.observe.records import RecordStore
    from reef_core.serve.middleware.usage import Usage

    tenancy = TokenSet.from_config(compose_config([
        "server.scoped_tokens=[{name:shared,token:t,scenarios:['s-*'],budget_tokens:50,budget_period:day}]"]).server)
    principal = tenancy.principal("t")
    store = RecordStore.open(None, tmp_path)
    try:
        replicas = [Usage(tenancy, clock=Clock()), Usage(tenancy, clock=Clock())]
        for usage in replicas:
            usage.load(store)
            usage.admit(principal, "s-1")
            usage.spend(principal, "s-1", 30)
        for usage in replicas:
            asyncio.run(usage.flush(store))
        assert replicas[0].snapshot()["shared"]["tokens"] == 30  # flushed first: the other's spending came later
        asyncio.run(replicas[0].flush(store))  # nothing to add; the read-back brings the other's 30 tokens
        for usage in replicas:
            with pytest.raises(RateLimited) as info:
                usage.admit(principal, "s-1")
            assert 1 <= info.value.details["retry_after"] <= 86400  # until the next UTC day
            assert usage.snapshot()["shared"]["tokens"] == 60
    finally:
        store.close()


def test_windows_keep_only_the_last_minute():
    from reef_core.serve.middleware.usage import SlidingWindow

    window = SlidingWindow()
    for second in range(600):
        window.add(float(second), 1)
    assert len(window.events) == 60 and window.used(600.0) == 59
