"""Release aliases over real HTTP: listing, audited moves (who, when, from, to, why), refusals that store nothing,
``production`` moved through the rollback path, aliases in the comparison, and ``x-reef-release`` pinning."""

from __future__ import annotations

from urllib.parse import quote

import httpx
import pytest

from reef_core.background import serve_asgi
from reef_core.config import compose_config
from reef_core.loop.assemble import build_deployment
from reef_core.serve.app import create_app
from reef_core.testing.release_loop import ADMIN, TOKEN, release_loop

AS_ADMIN = {"authorization": f"Bearer {ADMIN}"}
AS_READER = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def loop(tmp_path_factory, fake_upstream_url):
    with release_loop(tmp_path_factory.mktemp("alias") / "data", fake_upstream_url, scenario="alias loop",
                      overrides=("+recipe.surface_options.inject=system",)) as found:
        yield found


def _url(loop, path: str = "") -> str:
    return f"{loop.url}/reef/scenarios/{quote(loop.scenario, safe='')}{path}"


def _aliases(loop) -> dict:
    rows = httpx.get(_url(loop, "/aliases"), headers=AS_READER).json()["aliases"]
    return {row["alias"]: row for row in rows}


def _move(loop, name: str, body, headers=AS_ADMIN) -> httpx.Response:
    return httpx.put(_url(loop, f"/aliases/{name}"), json=body, headers=headers, timeout=30)


def _history(loop, name: str) -> httpx.Response:
    return httpx.get(_url(loop, f"/aliases/{name}/history"), headers=AS_READER)


def test_staging_moves_are_audited(loop):
    first, second = loop.served
    assert {name: row["release_id"] for name, row in _aliases(loop).items()} == {"production": loop.head}
    assert _history(loop, "staging").status_code == 404

    moved = _move(loop, "staging", {"release": first, "reason": "candidate for the canary"})
    assert moved.status_code == 200, moved.text
    assert moved.json()["from"] is None and moved.json()["to"] == first
    again = _move(loop, "staging", {"release": second, "reason": "newer candidate"}).json()
    assert (again["from"], again["to"], again["by"]) == (first, second, "admin_tokens[0]")

    listed = _aliases(loop)
    assert listed["staging"]["release_id"] == second and listed["staging"]["reason"] == "newer candidate"
    assert listed["production"]["release_id"] == loop.head  # moving staging serves nothing new
    moves = _history(loop, "staging").json()["moves"]
    assert [(m["from"], m["to"], m["reason"]) for m in moves] == [
        (first, second, "newer candidate"), (None, first, "candidate for the canary")]
    assert all(m["by"] == "admin_tokens[0]" and m["at"].endswith("Z") for m in moves)


@pytest.mark.parametrize("name, body, status, field", [
    ("staging", {"release": "FIRST", "reason": "x", "force": True}, 400, "force"),
    ("staging", {"release": "FIRST"}, 400, "reason"),
    ("staging", {"release": "FIRST", "reason": " "}, 400, "reason"),
    ("staging", {"release": "FIRST", "reason": "a\x1bb"}, 400, "reason"),
    ("staging", {"release": 7, "reason": "x"}, 400, "release"),
    ("staging", {"release": "0" * 40, "reason": "x"}, 404, "release"),
    ("Staging", {"release": "FIRST", "reason": "x"}, 400, "alias"),
    ("a" * 40, {"release": "FIRST", "reason": "x"}, 400, "alias"),
    ("production", {"release": "0" * 40, "reason": "x"}, 404, "release"),
    ("staging", [1], 400, None),
])
def test_refused_moves_store_nothing(loop, name, body, status, field):
    body = {k: loop.served[0] if v == "FIRST" else v for k, v in body.items()} if isinstance(body, dict) else body
    before = (_aliases(loop), _history(loop, "staging").text, httpx.get(_url(loop, "/releases"),
                                                                        headers=AS_READER).json())
    answer = _move(loop, name, body)
    assert answer.status_code == status, answer.text
    if field:
        assert answer.json()["error"]["message"].startswith(f"{field}:")
    after = (_aliases(loop), _history(loop, "staging").text, httpx.get(_url(loop, "/releases"),
                                                                       headers=AS_READER).json())
    assert after == before


def test_only_admin_moves(loop):
    answer = _move(loop, "qa", {"release": loop.served[0], "reason": "x"}, headers=AS_READER)
    assert answer.status_code == 403
    assert "qa" not in _aliases(loop)


def test_pin_serves_the_aliased_harness(loop):
    first = loop.served[0]
    assert _move(loop, "qa", {"release": first, "reason": "pin test"}).status_code == 200

    def chat(headers):
        return httpx.post(f"{loop.url}/v1/chat/completions", headers={"x-reef-scenario": loop.scenario, **headers},
                          json={"model": "m", "messages": [{"role": "user", "content": "pinned?"}]}, timeout=30)

    answer = chat({**AS_ADMIN, "x-reef-release": "qa"})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-reef-release-id"] == first
    record = httpx.get(_url(loop, f"/records/{answer.headers['x-reef-agent-record-id']}"), headers=AS_READER).json()
    assert record["artifact_ref"] == first and record["payload"]["pinned"] == "qa"
    assert "step 0" in str(record["payload"]["request"]["messages"][0])  # the seed's prompt, not the head's
    head = chat(AS_ADMIN)
    assert head.headers["x-reef-release-id"] == loop.head

    count = len(httpx.get(_url(loop, "/records"), headers=AS_READER).json()["records"])
    for headers, status in (({**AS_READER, "x-reef-release": "qa"}, 403), ({**AS_ADMIN, "x-reef-release": "nope"}, 404),
                            ({**AS_ADMIN, "x-reef-release": "x" * 201}, 400)):
        refused = chat(headers)
        assert refused.status_code == status, refused.text
        assert "x-reef-release" in refused.json()["error"]["message"]
    assert len(httpx.get(_url(loop, "/records"), headers=AS_READER).json()["records"]) == count


def test_compare_takes_alias_names(loop):
    body = httpx.get(_url(loop, "/releases/compare"), params={"a": "qa", "b": loop.served[1]},
                     headers=AS_READER).json()
    assert body["a"]["release_id"] == loop.served[0] and body["a"]["scored"] == 4


def test_production_moves_by_rollback(loop):
    # Last in the module: it changes what serves.
    first = loop.served[0]
    moved = _move(loop, "production", {"release": first, "reason": "regression in the head"})
    assert moved.status_code == 200, moved.text
    body = moved.json()
    assert body["operation"] == "rollback" and body["from"] == loop.head and body["target_release_id"] == first
    rows = httpx.get(_url(loop, "/releases"), headers=AS_READER).json()["releases"]
    assert rows[0]["release_id"] == body["to"] and rows[0]["operation"] == "rollback" and rows[0]["current"]
    assert rows[0]["source"]["by"] == "admin_tokens[0]" and rows[0]["source"]["reason"] == "regression in the head"
    assert _aliases(loop)["production"]["release_id"] == body["to"]
    history = _history(loop, "production").json()["moves"]
    assert history[0]["operation"] == "rollback" and history[0]["from"] == loop.head
    assert history[0]["reason"] == "regression in the head" and history[0]["target_release_id"] == first
    assert [m["operation"] for m in history] == ["rollback", "training", "training", "creation"]
    # Already there: nothing new is published.
    again = _move(loop, "production", {"release": body["to"], "reason": "again"}).json()
    assert again["moved"] is False
    assert len(httpx.get(_url(loop, "/releases"), headers=AS_READER).json()["releases"]) == len(rows)


def test_pin_refused_where_only_the_head_serves(tmp_path, fake_upstream_url):
    cfg = compose_config(["engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                          f"storage.data_dir={tmp_path}/data"])
    with serve_asgi(create_app(build_deployment(cfg)), lifespan="on") as url:
        def chat(headers):
            return httpx.post(f"{url}/v1/chat/completions", headers={"x-reef-scenario": "plain", **headers},
                              json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)

        new = chat({"x-reef-release": "staging"})  # before the scenario exists: refused, nothing created
        assert new.status_code == 404 and "x-reef-release" in new.json()["error"]["message"]
        assert httpx.get(f"{url}/reef/scenarios").json()["scenarios"] == []
        assert chat({}).status_code == 200
        refused = chat({"x-reef-release": "staging"})
        assert refused.status_code == 400
        assert refused.json()["error"]["message"].startswith("x-reef-release: ")
        assert "harness" in refused.json()["error"]["message"]
        assert chat({"x-reef-release": "production"}).status_code == 200  # the head: nothing to pin
