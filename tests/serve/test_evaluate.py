"""``POST /reef/scenarios/{s}/evaluate`` over real HTTP on harness releases: a named release, an alias,
``production`` and the candidate held for review each answer on the private client of the provider with their own
system prompt; nothing is recorded (no receipt, no record, no scenario); scopes; every refusal stores nothing; a
busy private engine answers 429."""

from __future__ import annotations

import threading
import time
from urllib.parse import quote

import httpx
import pytest

from reef_core.background import serve_asgi
from reef_core.commit.commitlog import CommitLog
from reef_core.commit.committer import Committer
from reef_core.commit.git_store import GitArtifactStore
from reef_core.config import compose_config
from reef_core.loop import evaluate as evaluate_module
from reef_core.loop.assemble import build_deployment
from reef_core.serve.app import create_app

SCENARIO = "ev loop"
READER, ADMIN, EVAL, ELSEWHERE = "ev-read", "ev-admin", "ev-eval", "ev-elsewhere"
AS = {name: {"authorization": f"Bearer {token}"} for name, token in
      (("reader", READER), ("admin", ADMIN), ("eval", EVAL), ("elsewhere", ELSEWHERE))}
PROMPTS = {"a": b"You are release A.", "b": b"You are release B.", "held": b"You are candidate C."}


def _config(data, upstream_url):
    scoped = (f"server.scoped_tokens=[{{name:harness-eval,token:{EVAL},scenarios:['ev *'],scopes:[eval]}},"
              f"{{name:other-team,token:{ELSEWHERE},scenarios:['other-*'],scopes:[eval,read]}}]")
    return compose_config(["engine.kind=upstream", f"engine.upstream_url={upstream_url}", f"storage.data_dir={data}",
                           f"server.tokens=[{READER}]", f"server.admin_tokens=[{ADMIN}]", scoped,
                           "recipe.surface=harness"])


@pytest.fixture(scope="module")
def served(tmp_path_factory, fake_upstream_url):
    """(url, deployment, release ids): two chain releases and one held for review, made before the server starts."""
    data = tmp_path_factory.mktemp("evaluate") / "data"
    cfg = _config(data, fake_upstream_url)
    with serve_asgi(create_app(build_deployment(cfg)), lifespan="on") as url:  # the scenario's first record
        answer = httpx.post(f"{url}/v1/chat/completions", headers={**AS["admin"], "x-reef-scenario": SCENARIO},
                            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert answer.status_code == 200, answer.text
    store = GitArtifactStore(data / "artifacts.git", data / "artifacts-work")
    committer = Committer(store, CommitLog.for_scenario(data / "commits", SCENARIO), SCENARIO)
    a, _ = committer.publish({"system_prompt.md": PROMPTS["a"]}, expected_head=None)
    b, _ = committer.publish({"system_prompt.md": PROMPTS["b"]}, expected_head=a.release_id)
    held, _ = committer.publish({"system_prompt.md": PROMPTS["held"]}, expected_head=b.release_id, hold=True)
    committer.log.close()
    deployment = build_deployment(_config(data, fake_upstream_url))
    with serve_asgi(create_app(deployment), lifespan="on") as url:
        yield url, deployment, {"a": a.release_id, "b": b.release_id, "held": held.release_id}


def _url(url, path="", scenario=SCENARIO):
    return f"{url}/reef/scenarios/{quote(scenario, safe='')}{path}"


def _evaluate(url, body, who="admin", scenario=SCENARIO, timeout=30) -> httpx.Response:
    return httpx.post(_url(url, "/evaluate", scenario), json=body, headers=AS[who], timeout=timeout)


def _body(release, text="What do you say?", **more):
    return {"release": release, "messages": [{"role": "user", "content": text}], **more}


def _stored(url) -> tuple:
    """What a request could have written: the scenario's records and releases, the aliases, the scenarios."""
    records = httpx.get(_url(url, "/records"), headers=AS["reader"]).json()["records"]
    releases = httpx.get(_url(url, "/releases"), headers=AS["reader"]).json()["releases"]
    aliases = httpx.get(_url(url, "/aliases"), headers=AS["reader"]).json()["aliases"]
    scenarios = httpx.get(f"{url}/reef/scenarios", headers=AS["reader"]).json()["scenarios"]
    return records, releases, aliases, scenarios


def _system_sent(upstream) -> str:
    sent = upstream.requests()[-1]["body"]["messages"]
    assert sent[0]["role"] == "system", sent
    return sent[0]["content"]


@pytest.mark.parametrize("name, release", [("a", "a"), ("b", "b"), ("production", "b"), ("candidate", "held")])
def test_each_release_answers_with_its_own_prompt_and_nothing_is_recorded(served, upstream, name, release):
    url, _dep, ids = served
    asked = ids[name] if name in ids else name
    before = _stored(url)
    answer = _evaluate(url, _body(asked, max_tokens=16, temperature=0.5, seed=7))
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert answer.headers["x-reef-release-id"] == ids[release] and "x-reef-agent-record-id" not in answer.headers
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "echo: What do you say?"
    assert body["reef"] == {"scenario": SCENARIO, "release_id": ids[release], "release": asked, "surface": "harness",
                            "content_id": body["reef"]["content_id"], "recorded": False}
    assert PROMPTS[release].decode() in _system_sent(upstream)
    sent = upstream.requests()[-1]["body"]
    assert (sent["max_tokens"], sent["temperature"], sent["seed"]) == (16, 0.5, 7)
    assert _stored(url) == before


def test_an_alias_names_the_release_it_points_at(served, upstream):
    url, _dep, ids = served
    moved = httpx.put(_url(url, "/aliases/staging"), json={"release": ids["a"], "reason": "eval"}, headers=AS["admin"])
    assert moved.status_code == 200, moved.text
    answer = _evaluate(url, _body("staging"), who="eval")  # the eval scope alone
    assert answer.status_code == 200, answer.text
    assert answer.json()["reef"]["release_id"] == ids["a"] and PROMPTS["a"].decode() in _system_sent(upstream)


@pytest.mark.parametrize("who, scenario, status", [("reader", SCENARIO, 403), ("elsewhere", SCENARIO, 403),
                                                   ("admin", "nope", 404), ("eval", "ev none", 404)])
def test_who_may_evaluate_and_where(served, who, scenario, status):
    url, _dep, _ids = served
    before = _stored(url)
    answer = _evaluate(url, _body("production"), who=who, scenario=scenario)
    assert answer.status_code == status, answer.text
    assert set(answer.json()) == {"error"}
    assert _stored(url) == before


@pytest.mark.parametrize("body, status, field", [
    (_body("0" * 40), 404, "release"),
    (_body("qa"), 404, "release"),
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "release"),
    (_body(""), 400, "release"),
    (_body(7), 400, "release"),
    ({"release": "production"}, 400, "messages"),
    ({"release": "production", "messages": []}, 400, "messages"),
    ({"release": "production", "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role"),
    ({"release": "production", "messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ({"release": "production", "messages": [{"role": "user", "content": [{"type": "image_url",
                                                                          "image_url": {"url": "x"}}]}]},
     400, "messages[0].content[0].type"),
    (_body("production", max_tokens=0), 400, "max_tokens"),
    (_body("production", max_tokens=10**6), 400, "max_tokens"),
    (_body("production", temperature=3), 400, "temperature"),
    (_body("production", seed=2**64), 400, "seed"),
    (_body("production", stream=True), 400, "stream"),
    ([1], 400, None),
])
def test_refusals_name_the_field_and_store_nothing(served, upstream, body, status, field):
    url, _dep, _ids = served
    before, calls = _stored(url), len(upstream.requests())
    answer = _evaluate(url, body)
    assert answer.status_code == status, answer.text
    if field:
        assert answer.json()["error"]["message"].startswith(f"{field}:"), answer.text
    assert _stored(url) == before and len(upstream.requests()) == calls


def test_a_busy_private_engine_answers_429(served, upstream, monkeypatch):
    url, dep, _ids = served
    monkeypatch.setattr(evaluate_module, "ADMITTED", 1)
    upstream.faults({"delay_s": 1.5})
    answers = []
    slow = threading.Thread(target=lambda: answers.append(_evaluate(url, _body("production"))))
    slow.start()
    try:
        for _ in range(500):  # until the slow call holds the one slot (at most 10 s)
            if dep.evaluator._admitted:
                break
            time.sleep(0.02)
        refused = _evaluate(url, _body("production"))
    finally:
        slow.join(30)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "evaluation_busy"
    assert answers[0].status_code == 200
    assert _evaluate(url, _body("production")).status_code == 200  # the slot is free again
