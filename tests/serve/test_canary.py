"""Canary and A/B rollouts over real HTTP (``evaluation.rollout``): a canary's sticky share of live traffic, its
promotion or rollback by the one-sided Welch rule with the evidence in the chain (also across a restart mid-canary),
an admin's decision, and A/B arms.

The recipe is a harness one (``dashboard_loop.RewardTrainer``, every candidate selected): each batch of
:data:`BATCH` reports trains a candidate, which becomes the canary. Scores are the test's: it reports high or low
for the side that served (``x-reef-release-id``), so a better or a worse canary is made to order.
"""

from __future__ import annotations

from contextlib import contextmanager
from urllib.parse import quote

import httpx
import pytest
from openai import OpenAI

from reef_core.background import serve_asgi
from reef_core.config import compose_config
from reef_core.errors import ConfigError
from reef_core.loop.assemble import build_deployment
from reef_core.serve.app import create_app
from reef_core.testing.fixtures import wait_until

TOKEN, ADMIN = "canary-read-token", "canary-admin-token"
AS_ADMIN = {"authorization": f"Bearer {ADMIN}"}
AS_READER = {"authorization": f"Bearer {TOKEN}"}
BATCH = 4
SCENARIO = "canary loop"


def _config(data_dir, upstream_url, *rollout):
    return compose_config([
        "engine.kind=upstream", f"engine.upstream_url={upstream_url}", f"storage.data_dir={data_dir}",
        f"server.tokens=[{TOKEN}]", f"server.admin_tokens=[{ADMIN}]",
        "recipe.name=canary", "recipe.processor=per_report", f"+recipe.processor_options.batch_size={BATCH}",
        "recipe.trainer=reef_core.testing.dashboard_loop:RewardTrainer", "recipe.surface=harness",
        "+recipe.surface_options.inject=system", "evaluation.policy=always", *rollout])


@contextmanager
def _serve(data_dir, upstream_url, *rollout):
    with serve_asgi(create_app(build_deployment(_config(data_dir, upstream_url, *rollout))), lifespan="on") as url:
        with httpx.Client(base_url=url, headers={**AS_ADMIN, "x-reef-scenario": SCENARIO}, timeout=30) as client:
            yield client


def _path(tail: str) -> str:
    return f"/reef/scenarios/{quote(SCENARIO, safe='')}{tail}"


def _ask(client, session: str | None = None, text: str = "q") -> tuple[str, str]:
    """One chat request; its receipt and the release that served it."""
    headers = {"x-reef-tag-session": session} if session is not None else {}
    answer = client.post("/v1/chat/completions", headers=headers,
                         json={"model": "m", "messages": [{"role": "user", "content": text}]})
    assert answer.status_code == 200, answer.text
    return answer.headers["x-reef-agent-record-id"], answer.headers["x-reef-release-id"]


def _report(client, receipt: str, score: float) -> None:
    answer = client.post("/reef/report", json={"score": score, "references": [receipt]})
    assert answer.status_code == 200, answer.text


def _state(client) -> dict:
    answer = client.get(_path("/canary"))
    assert answer.status_code == 200, answer.text
    return answer.json()


def _canary(client) -> str:
    """Train one batch into a candidate and wait until it is the canary."""
    receipts = [_ask(client, text=f"train {i}")[0] for i in range(BATCH)]  # the first one creates the scenario
    head = _state(client)["production_release_id"]
    for receipt in receipts:
        _report(client, receipt, 0.5)
    found = wait_until(lambda: (_state(client)["canary"] or {}).get("release_id"), timeout=30,
                       what="a batch trained into a canary")
    assert _state(client)["production_release_id"] == head  # the canary does not move the head
    return found


def _decision_on(client, canary: str) -> dict | None:
    """The chain's last canary decision once it is the one on ``canary``."""
    found = _state(client)["last_decision"]
    return found if found is not None and found["canary"] == canary else None


def _releases(client) -> list[dict]:
    return client.get(_path("/releases")).json()["releases"]


def _drive(client, canary: str, canary_score: float, production_score: float, sessions: range) -> None:
    """One request per session, reported by the side that served it (scores alternate by 0.1 around the level),
    until the canary stops running (its decision), so the next canary's tally starts clean."""
    for i in sessions:
        if (_state(client)["canary"] or {}).get("release_id") != canary:
            return
        receipt, served = _ask(client, session=f"drive-{i}")
        level = canary_score if served == canary else production_score
        _report(client, receipt, level + (0.1 if i % 2 else 0.0))


def test_canary_share_is_sticky_by_session(tmp_path, fake_upstream_url):
    with _serve(tmp_path / "data", fake_upstream_url, "evaluation.rollout.strategy=canary",
                "evaluation.rollout.share=0.2", "evaluation.rollout.min_scored=1000",
                "evaluation.rollout.max_scored=null") as client:
        canary = _canary(client)
        head = _state(client)["production_release_id"]
        seen: dict[str, set[str]] = {}
        receipts: dict[str, str] = {}
        openai = OpenAI(base_url=f"{str(client.base_url).rstrip('/')}/v1", api_key=ADMIN, max_retries=0)
        for i in range(500):
            session = f"session-{i}"
            for turn in range(3 if i % 10 == 0 else 1):  # some sessions come back
                if turn == 1:  # the official SDK sends the same session tag
                    raw = openai.chat.completions.with_raw_response.create(
                        model="m", messages=[{"role": "user", "content": f"{session} again"}],
                        extra_headers={"x-reef-scenario": SCENARIO, "x-reef-tag-session": session})
                    receipt, served = raw.headers["x-reef-agent-record-id"], raw.headers["x-reef-release-id"]
                else:
                    receipt, served = _ask(client, session, f"{session} turn {turn}")
                seen.setdefault(session, set()).add(served)
                receipts[receipt] = served
        assert all(len(releases) == 1 for releases in seen.values()), "a session saw two releases"
        assert {r for releases in seen.values() for r in releases} == {head, canary}
        share = sum(1 for releases in seen.values() if canary in releases) / len(seen)
        assert 0.15 <= share <= 0.25, share

        # The records say which release served them: the version, and the side in the payload.
        versions, after = {}, 0
        while True:
            page = client.get(_path("/records"), params={"after_sequence": after, "limit": 100}).json()["records"]
            if not page:
                break
            versions.update({r["agent_record_id"]: r["artifact_ref"] for r in page})
            after = page[-1]["sequence"]
        assert all(versions[receipt] == served for receipt, served in receipts.items())
        for receipt, served in list(receipts.items())[:40]:
            payload = client.get(_path(f"/records/{receipt}")).json()["payload"]
            assert payload["rollout"]["canary"] == canary
            assert payload["rollout"]["arm"] == ("canary" if served == canary else "production")
            assert payload["rollout"].get("trains", True) is (served != canary)  # train_canary=false
        state = _state(client)
        assert state["strategy"] == "canary" and state["canary"]["share"] == 0.2
        assert state["test"]["decision"] == "collecting"


def test_rule_promotes_a_better_canary_and_rolls_back_a_worse_one_across_a_restart(tmp_path, fake_upstream_url):
    data = tmp_path / "data"
    rollout = ("evaluation.rollout.strategy=canary", "evaluation.rollout.share=0.5",
               "evaluation.rollout.min_scored=6", "evaluation.rollout.alpha=0.05")
    with _serve(data, fake_upstream_url, *rollout) as client:
        canary = _canary(client)
        head = _state(client)["production_release_id"]
        _drive(client, canary, 0.9, 0.2, range(0, 8))  # fewer than 6 scored on at least one side: no decision yet
        before = _state(client)
        assert before["canary"]["release_id"] == canary and before["test"]["decision"] == "collecting", before
        sticky = {f"drive-{i}": _ask(client, session=f"drive-{i}")[1] for i in range(4)}
    # Restarted mid-canary: the chain still names the canary, the records rebuild its tally, sessions keep sides.
    with _serve(data, fake_upstream_url, *rollout) as client:
        state = _state(client)
        assert state["canary"]["release_id"] == canary
        assert {k: v["scored"] for k, v in (("c", state["test"]["canary"]), ("p", state["test"]["production"]))} == \
            {"c": before["test"]["canary"]["scored"], "p": before["test"]["production"]["scored"]}
        assert {s: _ask(client, session=s)[1] for s in sticky} == sticky
        _drive(client, canary, 0.9, 0.2, range(8, 60))
        promoted = wait_until(lambda: _decision_on(client, canary), timeout=30, what="the rule decided the canary")
        assert promoted["decision"] == "promote" and promoted["canary"] == canary and promoted["by"] == "rule"
        evidence = promoted["evidence"]
        assert evidence["rule"] == "welch_t" and evidence["alpha"] == 0.05 and evidence["p_better"] < 0.05
        assert evidence["canary"]["scored"] >= 6 and evidence["production"]["scored"] >= 6
        assert evidence["canary"]["mean"] > evidence["production"]["mean"] and evidence["lower"] > 0
        rows = _releases(client)
        new_head = next(r for r in rows if r["current"])
        assert new_head["operation"] == "promote" and new_head["source"]["release_id"] == canary
        assert new_head["source"]["canary"]["evidence"]["p_better"] == evidence["p_better"]
        assert new_head["release_id"] != head
        commits = client.get(_path("/commits")).json()["commits"]
        row = next(c for c in commits if c.get("release_id") == new_head["release_id"])
        assert row["canary"]["decision"] == "promote" and row["canary"]["evidence"]["t"] == evidence["t"]
        aliases = {a["alias"]: a["release_id"] for a in client.get(_path("/aliases")).json()["aliases"]}
        assert aliases["production"] == new_head["release_id"]  # production moved with the promotion

        # The batches that waited train against the new head: the next candidate is a canary; this one is worse.
        second = wait_until(lambda: (_state(client)["canary"] or {}).get("release_id"), timeout=30,
                            what="the next canary")
        _drive(client, second, 0.1, 0.8, range(100, 108))  # 8 sessions: not 6 scored on both sides yet
        assert _state(client)["test"]["decision"] == "collecting"
    with _serve(data, fake_upstream_url, *rollout) as client:  # restarted again, mid-canary
        assert _state(client)["canary"]["release_id"] == second
        _drive(client, second, 0.1, 0.8, range(108, 160))
        rolled = wait_until(lambda: _decision_on(client, second), timeout=30, what="the rule rolled the canary back")
        assert rolled["decision"] == "rollback" and rolled["evidence"]["p_worse"] < 0.05
        head_row = next(r for r in _releases(client) if r["current"])
        assert head_row["operation"] == "rollback" and head_row["source"]["canary"]["release_id"] == second
        assert head_row["content_id"] == new_head["content_id"]  # what served before the canary serves on
        status = client.get(_path("/status")).json()
        assert status["dropped"].get("canary_served", 0) > 0  # the canaries' records did not train
        metrics = client.get("/metrics").text
        assert 'reason="canary_served"' in metrics


def test_admin_decides_a_canary(tmp_path, fake_upstream_url):
    with _serve(tmp_path / "data", fake_upstream_url, "evaluation.rollout.strategy=canary",
                "evaluation.rollout.min_scored=1000", "evaluation.rollout.max_scored=null") as client:
        first = _canary(client)
        steps = len(client.get(_path("/commits")).json()["commits"])
        for body, field in (({"action": "ship", "reason": "x"}, "action"), ({"action": "promote"}, "reason"),
                            ({"action": "promote", "reason": "x", "extra": 1}, "extra")):
            bad = client.post(_path("/canary"), json=body)
            assert bad.status_code == 400 and field in bad.json()["error"]["message"], bad.text
        reader = client.post(_path("/canary"), json={"action": "promote", "reason": "x"}, headers=AS_READER)
        assert reader.status_code == 403, reader.text
        assert len(client.get(_path("/commits")).json()["commits"]) == steps  # refusals wrote nothing
        assert _state(client)["canary"]["release_id"] == first

        done = client.post(_path("/canary"), json={"action": "promote", "reason": "looks good"})
        assert done.status_code == 200, done.text
        assert done.json()["canary"] == first and done.json()["by"] == "admin_tokens[0]"
        head = next(r for r in _releases(client) if r["current"])
        assert head["operation"] == "promote" and head["source"]["reason"] == "looks good"
        assert head["source"]["canary"]["decision"] == "promote"

        for i in range(BATCH):  # the next batch is the next canary
            receipt, _ = _ask(client, text=f"more {i}")
            _report(client, receipt, 0.5)
        second = wait_until(lambda: (_state(client)["canary"] or {}).get("release_id"), timeout=30,
                            what="the second canary")
        back = client.post(_path("/canary"), json={"action": "rollback", "reason": "not now"})
        assert back.status_code == 200, back.text
        refused = client.post(_path("/canary"), json={"action": "promote", "reason": "x"})
        assert refused.status_code == 409, refused.text  # no canary runs now
        rows = _releases(client)
        now = next(r for r in rows if r["current"])
        assert now["operation"] == "rollback" and now["source"]["canary"]["release_id"] == second
        assert now["content_id"] == head["content_id"] and _state(client)["canary"] is None
        assert next(r for r in rows if r["release_id"] == second)["pending"]  # withdrawn: held, never the head


def test_ab_arms_are_sticky_and_compared(tmp_path, fake_upstream_url):
    data = tmp_path / "data"
    with _serve(data, fake_upstream_url) as client:  # immediate: two releases in the chain
        receipts = [_ask(client, text=f"train {i}")[0] for i in range(BATCH)]
        first = _state(client)["production_release_id"]
        for receipt in receipts:
            _report(client, receipt, 0.5)
        wait_until(lambda: _state(client)["production_release_id"] != first, timeout=30, what="a new head")
        moved = client.put(_path("/aliases/baseline"), json={"release": first, "reason": "A/B arm"})
        assert moved.status_code == 200, moved.text
    with _serve(data, fake_upstream_url, "evaluation.rollout.strategy=ab",
                "evaluation.rollout.arms=[{release: baseline, share: 0.5}, {release: production, share: 0.5}]",
                "recipe.processor_options.batch_size=1000") as client:
        head = _state(client)["production_release_id"]
        seen = {}
        for i in range(60):
            for _ in range(2):
                receipt, served = _ask(client, session=f"ab-{i}")
                seen.setdefault(i, set()).add(served)
                _report(client, receipt, 1.0 if served == first else 0.0)
        assert all(len(s) == 1 for s in seen.values())
        assert {r for s in seen.values() for r in s} == {first, head}
        state = _state(client)
        arms = {a["release"]: a for a in state["arms"]}
        assert arms["baseline"]["release_id"] == first and arms["production"]["release_id"] == head
        on_first = sum(2 for s in seen.values() if first in s)
        assert 15 <= on_first // 2 <= 45  # half of 60 sessions, give or take
        # The baseline's records: its own round's (scored 0.5) and the A/B's (scored 1.0).
        assert arms["baseline"]["scored"] == on_first + BATCH and arms["production"]["scored"] == 120 - on_first
        assert arms["production"]["mean"] == 0.0 and arms["baseline"]["mean"] > 0.9
        compared = client.get(_path("/releases/compare"), params={"a": "production", "b": "baseline"}).json()
        assert compared["b"]["scored"] == arms["baseline"]["scored"] and compared["b"]["mean"] == arms["baseline"]["mean"]
        payload = client.get(_path(f"/records/{receipt}")).json()["payload"]
        assert payload["rollout"]["strategy"] == "ab" and payload["rollout"]["release_id"] == served


@pytest.mark.parametrize("overrides, named", [
    (["evaluation.rollout.strategy=blue_green"], "evaluation.rollout.strategy"),
    (["evaluation.rollout.share=0"], "evaluation.rollout.share"),
    (["evaluation.rollout.alpha=0.7"], "evaluation.rollout.alpha"),
    (["evaluation.rollout.min_scored=1"], "evaluation.rollout.min_scored"),
    (["evaluation.rollout.max_scored=3"], "evaluation.rollout.max_scored"),
    (["evaluation.rollout.sticky=Bad Tag"], "evaluation.rollout.sticky"),
    (["evaluation.rollout.rule=bootstrap"], "evaluation.rollout.rule"),
    (["+evaluation.rollout.shares=0.2"], "evaluation.rollout.shares"),
    (["evaluation.rollout.strategy=ab", "evaluation.rollout.arms=[{release: a, share: 0.4}, {release: b, share: 0.4}]"],
     "evaluation.rollout.arms"),
    (["evaluation.rollout.arms=[{release: a, share: 0.5}, {release: b, share: 0.5}]"], "evaluation.rollout.arms"),
])
def test_invalid_rollout_config_is_refused_naming_the_key(overrides, named):
    with pytest.raises(ConfigError) as refused:
        compose_config(overrides)
    assert named in refused.value.message


@pytest.mark.parametrize("overrides, why", [
    (["recipe.surface=skills"], "skills surface"),
    (["recipe.surface=harness", "recipe.trainer=reef_core.testing.dashboard_loop:RewardTrainer",
      "recipe.processor=per_report", "evaluation.publish=review"], "evaluation.publish=auto"),
    (["recipe.surface=harness", "server.learner=false"], "server.learner=true"),
])
def test_a_rollout_this_deployment_cannot_serve_is_refused_at_start_up(tmp_path, fake_upstream_url, overrides, why):
    cfg = compose_config(["engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                          f"storage.data_dir={tmp_path}", "evaluation.rollout.strategy=canary", *overrides])
    with pytest.raises(ConfigError) as refused:
        build_deployment(cfg)
    assert "evaluation.rollout.strategy=canary" in refused.value.message and why in refused.value.message


def test_a_weights_recipe_cannot_roll_out():
    """A weights surface serves the engine's one loaded state: no request can be served by another release."""
    from types import SimpleNamespace

    from reef_core.config.recipes import recipe_bindings
    from reef_core.loop.rollout import check_binding

    binding = recipe_bindings(compose_config(["recipe.surface=weights", "evaluation.rollout.strategy=ab",
                                              "evaluation.rollout.arms=[{release: a, share: 0.5}, "
                                              "{release: b, share: 0.5}]"]))["none"]
    with pytest.raises(ConfigError) as refused:
        check_binding(binding, SimpleNamespace(kind="weights"), role="all", workers=1)
    assert "evaluation.rollout.strategy=ab" in refused.value.message and "weights surface" in refused.value.message
