"""The skill surface over real HTTP: a whole Reef server (``+recipe=skillclaw``) in front of the fake provider.

Clients are the official ``openai`` and ``anthropic`` SDKs over loopback. The engine speaks OpenAI in one server
and Anthropic in the other, so the catalog is checked where the provider receives it, in both dialects, plain
and streamed; a client that sends the catalog itself does not get a second one; ``GET /reef/skills/{slug}``
validates the slug at the door and serves the body; ``GET /reef/harness`` serves the tree; close-day is admin.
"""

from __future__ import annotations

import contextlib

import anthropic
import httpx
import openai
import pytest

from reef_core.api import serve_reef
from reef_core.content import content_text
from reef_core.surfaces.skills import CATALOG_OPEN
from reef_core.testing.fake_upstream import FakeUpstream, serve_fake_upstream
from reef_core.testing.fixtures import wait_until

TOKEN, ADMIN = "inference-token", "admin-token"
SCENARIO = "skills-http"


@pytest.fixture(scope="module", params=["openai", "anthropic"])
def server(request, tmp_path_factory):
    """(Reef URL, fake provider app, engine dialect)."""
    fake = FakeUpstream()
    with contextlib.ExitStack() as stack:
        upstream_url = stack.enter_context(serve_fake_upstream(app=fake))
        url = stack.enter_context(serve_reef([
            "+recipe=skillclaw", "engine.kind=upstream", f"engine.upstream_url={upstream_url}",
            f"engine.upstream_dialect={request.param}", "engine.upstream_model=fake-model",
            f"storage.data_dir={tmp_path_factory.mktemp('skills')}",
            "recipe.options.initial_skills=reef_skillclaw.examples:seed_skills",
            "recipe.options.evolver_model=reef_skillclaw.examples:evolver", "recipe.options.batch_size=50",
            f"server.tokens=[{TOKEN}]", f"server.admin_tokens=[{ADMIN}]", "server.log_level=warning"]))
        yield url, fake, request.param


def _openai(url: str, scenario: str = SCENARIO) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, default_headers={"x-reef-scenario": scenario},
                         max_retries=0)


def _anthropic(url: str, scenario: str = SCENARIO) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=TOKEN, default_headers={"x-reef-scenario": scenario},
                               max_retries=0)


def _http(url: str, scenario: str = SCENARIO, token: str = TOKEN) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"x-reef-scenario": scenario, "authorization": f"Bearer {token}"},
                        timeout=30)


def _system_seen(fake: FakeUpstream, dialect: str) -> str:
    """The system prompt of the provider's last request, in its own dialect."""
    body = fake.requests_log()[-1]["body"]
    if dialect == "anthropic":
        return content_text(body.get("system"), non_text="skip")
    first = body["messages"][0]
    return content_text(first["content"], non_text="skip") if first["role"] in ("system", "developer") else ""


def test_catalog_reaches_the_provider_from_both_sdks_plain_and_streamed(server):
    url, fake, dialect = server
    with _openai(url) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="fake-model", messages=[{"role": "user", "content": "hello"}])
        release_id = raw.headers["x-reef-release-id"]
        assert raw.parse().choices[0].message.content
    seen = _system_seen(fake, dialect)
    assert seen.count(CATALOG_OPEN) == 1 and "- deploy-basics [deploy]:" in seen

    with _openai(url) as client:  # streamed, with the client's own system prompt kept after the catalog
        with client.chat.completions.with_streaming_response.create(
                model="fake-model", stream=True,
                messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]) as stream:
            assert stream.headers["x-reef-release-id"] == release_id
            text = "".join(chunk.choices[0].delta.content or "" for chunk in stream.parse() if chunk.choices)
    assert text
    seen = _system_seen(fake, dialect)
    assert seen.startswith(CATALOG_OPEN) and seen.endswith("Be brief.") and seen.count(CATALOG_OPEN) == 1

    with _anthropic(url) as client:
        raw = client.messages.with_raw_response.create(model="fake-model", max_tokens=16,
                                                       messages=[{"role": "user", "content": "hello"}])
        assert raw.headers["x-reef-release-id"] == release_id and raw.parse().content
        with client.messages.stream(model="fake-model", max_tokens=16, system="Own rules.",
                                    messages=[{"role": "user", "content": "hi"}]) as stream:
            assert stream.get_final_message().content
    seen = _system_seen(fake, dialect)
    assert seen.count(CATALOG_OPEN) == 1 and "deploy-basics" in seen and seen.endswith("Own rules.")


def test_catalog_is_never_injected_twice_and_records_hold_it(server):
    url, fake, dialect = server
    with _http(url) as http:
        catalog = http.get("/reef/skills").json()["catalog"]
    with _openai(url) as client:  # a client that pulled the catalog and sends it itself
        raw = client.chat.completions.with_raw_response.create(
            model="fake-model", messages=[{"role": "system", "content": catalog + "\n\nMine."},
                                          {"role": "user", "content": "hello"}])
        receipt = raw.headers["x-reef-agent-record-id"]
    assert _system_seen(fake, dialect) == catalog + "\n\nMine."
    with _http(url) as http:  # the record is what the provider saw: one catalog
        record = http.get(f"/reef/scenarios/{SCENARIO}/records/{receipt}").json()
    request = record["payload"]["request"]
    system = request.get("system") if dialect == "anthropic" else request["messages"][0]["content"]
    assert content_text(system, non_text="skip").count(CATALOG_OPEN) == 1


def test_skill_reads_are_validated_at_the_door(server):
    url, _fake, _dialect = server
    with _openai(url) as client:  # the scenario exists once it served a request
        client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}])
    with _http(url) as http:
        found = http.get("/reef/skills/deploy-basics")
        assert found.status_code == 200
        body = found.json()
        assert (body["slug"], body["category"], body["path"]) == ("deploy-basics", "deploy",
                                                                  "skills/deploy-basics/SKILL.md")
        assert body["text"].startswith("---\nname: deploy-basics") and "run_task" in body["body"]
        assert found.headers["x-reef-release-id"] == body["release_id"]
        listing = http.get("/reef/skills").json()
        assert [s["slug"] for s in listing["skills"]] == ["deploy-basics"]
        assert listing["catalog"].startswith(CATALOG_OPEN)
        for bad in ["Deploy", "a_b", "..", "%2e%2e", "x" * 70, "a--b"]:
            response = http.get(f"/reef/skills/{bad}")
            assert response.status_code in (400, 404), (bad, response.status_code)
            if response.status_code == 404:  # the router's own 404 (path did not match), never a lookup
                assert "unknown skill" not in response.text
        assert http.get("/reef/skills/Deploy").status_code == 400
        missing = http.get("/reef/skills/no-such-skill")
        assert missing.status_code == 404 and "no skill" in missing.json()["error"]["message"]
        assert http.get("/reef/skills/deploy-basics", headers={"x-reef-scenario": "never-seen"}).status_code == 404
        tree = http.get("/reef/harness").json()
        assert set(tree["files"]) == {"skills/deploy-basics/SKILL.md"}
        assert tree["files"]["skills/deploy-basics/SKILL.md"] == body["text"]


def test_close_day_is_admin_and_closes_a_partial_day(server):
    url, _fake, dialect = server
    scenario = f"close-{dialect}"
    with _openai(url, scenario) as client:
        raw = client.chat.completions.with_raw_response.create(model="fake-model",
                                                               messages=[{"role": "user", "content": "x"}])
        receipt = raw.headers["x-reef-agent-record-id"]
    with _http(url, scenario) as http:
        report = http.post("/reef/report", json={"score": 0.0, "references": [receipt],
                                                 "metadata": {"task": "t1", "category": "deploy"}})
        assert report.status_code == 200, report.text
        path = f"/reef/scenarios/{scenario}/skills/close-day"
        assert http.post(path).status_code == 403  # an inference token may not close a day
        with _http(url, scenario, ADMIN) as admin:
            assert admin.post(path, json={"x": 1}).status_code == 400
            assert admin.post("/reef/scenarios/never-seen/skills/close-day").status_code == 404
            closed = admin.post(path)
            assert closed.status_code == 200, closed.text
            assert closed.json()["closed_through"] >= 2
        # One session, far below batch_size 50: the night runs on it (one commit after the creation).

        def nights():
            rows = http.get(f"/reef/scenarios/{scenario}/commits").json()["commits"]
            return [row for row in rows if row.get("operation") != "creation"]

        wait_until(lambda: nights(), timeout=60, interval=0.02, what="the night of the closed day")
        done = nights()
        assert len(done) == 1 and set(done[0]["consumed_ids"]) >= {receipt}


def test_injected_catalog_is_capped_over_http(tmp_path):
    """A pool whose catalog exceeds ``catalog_max_bytes``: the provider gets a catalog within the cap that says how
    many skills it leaves out; every skill is still readable."""
    skills = ",".join(f"s{i:02d}:{{description:'{'Long description. ' * 8}NOT for: other work.',category:c,"
                      f"body:'Body {i}.'}}" for i in range(20))
    fake = FakeUpstream()
    with serve_fake_upstream(app=fake) as upstream_url, serve_reef([
            "+recipe=skillclaw", "engine.kind=upstream", f"engine.upstream_url={upstream_url}",
            "engine.upstream_model=fake-model", f"storage.data_dir={tmp_path}",
            f"recipe.options.initial_skills={{{skills}}}", "+recipe.surface_options.catalog_max_bytes=1024",
            "server.log_level=warning"]) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", default_headers={"x-reef-scenario": "capped"},
                               max_retries=0)
        client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}])
        client.close()
        seen = _system_seen(fake, "openai")
        assert len(seen.encode()) <= 1024 and seen.startswith(CATALOG_OPEN)
        listed = [line for line in seen.splitlines() if line.startswith("- s")]
        assert 0 < len(listed) < 20 and f"({20 - len(listed)} more skills not listed)" in seen
        with httpx.Client(base_url=url, headers={"x-reef-scenario": "capped"}, timeout=30) as http:
            assert http.get("/reef/skills/s19").json()["body"] == "Body 19."
            assert len(http.get("/reef/skills").json()["skills"]) == 20
