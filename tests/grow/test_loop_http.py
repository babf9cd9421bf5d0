"""The learning loop over real HTTP: serving stays live while versions are trained and published.

Uses the SAO recipe package (a real weights trainer) with its tiny-model CPU profile, a real
`reef serve` process, the openai SDK, real git releases and real torch weights.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from reef_core.commit.git_store import GitArtifactStore
from reef_core.testing.fixtures import wait_until

reef_sao_tasks = pytest.importorskip("reef_sao.tasks")

pytestmark = pytest.mark.slow


def _chat(client, scenario, messages):
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages,
                                                           extra_headers={"x-reef-scenario": scenario})
    return raw.headers["x-reef-agent-record-id"], raw.parse().choices[0].message.content or ""


def _releases(server, scenario):
    response = httpx.get(f"{server.url}/reef/scenarios/{scenario}/releases")
    return response.json()["releases"] if response.status_code == 200 else []


def _records(server, scenario):
    rows, after = [], 0
    while True:
        page = httpx.get(f"{server.url}/reef/scenarios/{scenario}/records",
                         params={"after_sequence": after, "limit": 100}).json()
        rows += page["records"]
        if page["next_after_sequence"] is None:
            return rows
        after = page["next_after_sequence"]


def _logprobs(model, prompt_ids, output_ids):
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output_ids)[:, None])[:, 0]


def test_versions_publish_while_serving(reef_server, tmp_path):
    server = reef_server("+recipe=sao", "+sao_profile=tiny", "engine.seed=0", "seed=0",
                         "trainer.checkpoint_every_n_versions=1")
    scenario = "vowels"
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    failures: list[str] = []
    served = {"n": 0}
    stop = threading.Event()

    def bystander():
        # A concurrent client that never reports: every one of its requests must succeed, swaps or not.
        local = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        while not stop.is_set():
            try:
                _chat(local, scenario, [{"role": "user", "content": "keep talking"}])
                served["n"] += 1
            except Exception as exc:  # noqa: BLE001 - collected and asserted on below
                failures.append(repr(exc))

    thread = threading.Thread(target=bystander, daemon=True)
    thread.start()
    deadline = time.monotonic() + 400
    tasks = reef_sao_tasks.task_stream(seed=0)
    try:
        while time.monotonic() < deadline:
            task = next(tasks)
            receipt, text = _chat(client, scenario, task.messages())
            report = httpx.post(f"{server.url}/reef/report", headers={"x-reef-scenario": scenario},
                                json={"score": reef_sao_tasks.letter_share(task, text), "references": [receipt]})
            assert report.status_code == 200, report.text
            trained = [r for r in _releases(server, scenario) if r["operation"] == "training"]
            if len(trained) >= 3:
                break
    finally:
        stop.set()
        thread.join(60)
    assert len(trained) >= 3, server.log()
    assert not failures, failures[:3]
    assert served["n"] > 0

    # Every record names the version that served it, and that version's published weights
    # reproduce the log-probs recorded for its tokens.
    from reef_core.models.loading import load_model

    base_dir = Path(__import__("os").environ["REEF_MODEL_CACHE"]) / "tiny"
    store = GitArtifactStore(server.data_dir / "artifacts.git", tmp_path / "reader")
    release_of = {r["metrics"].get("serving_version"): r["release_id"] for r in _releases(server, scenario)
                  if r["metrics"].get("serving_version")}
    records = [r for r in _records(server, scenario) if r["request_type"] == "inference"]
    versions = {r["artifact_ref"] for r in records}
    assert len(versions) >= 3
    checked = 0
    for version in sorted(versions):
        model, _ = load_model(base_dir)
        if not version.endswith(":0"):
            if version not in release_of:
                continue  # a version no record-producing check can reach (e.g. replaced before use)
            from safetensors.torch import load as load_safetensors

            files = store.read_files(release_of[version])
            model.load_state_dict(load_safetensors(files["model.safetensors"]), strict=False)
        sample = [r for r in records if r["artifact_ref"] == version][:2]
        for row in sample:
            detail = httpx.get(f"{server.url}/reef/scenarios/{scenario}/records/{row['agent_record_id']}").json()
            tokens = detail["payload"]["tokens"]
            assert tokens["version"] == version
            recomputed = _logprobs(model, tokens["prompt_ids"], tokens["output_ids"])
            assert torch.allclose(recomputed, torch.tensor(tokens["output_logprobs"]), atol=2e-3), version
            checked += 1
    assert checked >= 3
    publish = [r["metrics"].get("publish_latency_ms") for r in trained]
    assert any(p is not None for p in publish)
    status = httpx.get(f"{server.url}/reef/scenarios/{scenario}/status").json()
    assert status["counters"]["selected"] >= 3 and status["last_error"] is None


def _commits(server, scenario):
    return httpx.get(f"{server.url}/reef/scenarios/{scenario}/commits", params={"limit": 100}).json()["commits"]


def _report_tasks(server, client, scenario, tasks, n):
    for _ in range(n):
        task = next(tasks)
        receipt, text = _chat(client, scenario, task.messages())
        response = httpx.post(f"{server.url}/reef/report", headers={"x-reef-scenario": scenario},
                              json={"score": reef_sao_tasks.letter_share(task, text), "references": [receipt]})
        assert response.status_code == 200


def test_rejected_candidate_changes_nothing_that_serves(reef_server):
    # The floor policy with no evaluation tasks rejects every candidate.
    server = reef_server("+recipe=sao", "+sao_profile=tiny", "evaluation.policy=floor",
                         "+evaluation.options.policy.floor_score=0.5")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    scenario = "gated"
    _report_tasks(server, client, scenario, reef_sao_tasks.task_stream(seed=3), 8)  # two batches of 4
    rows = wait_until(lambda: (c := _commits(server, scenario)) and len(c) >= 3 and c)
    assert rows[0]["operation"] == "creation"  # release 0: the base model reference
    rows = rows[1:]
    assert all(row["release_id"] is None and row["decision"]["decision"] == "reject" for row in rows)
    assert "floor" in rows[0]["decision"]["reason"] or "no task scores" in rows[0]["decision"]["reason"]
    assert sum(len(row["consumed_ids"]) for row in rows) == 16  # 8 receipts + 8 reports, consumed once
    assert [r["operation"] for r in _releases(server, scenario)] == ["creation"]
    status = httpx.get(f"{server.url}/reef/scenarios/{scenario}/status").json()
    assert status["current_version"].endswith(":0") and status["counters"]["rejected"] >= 2


def test_restart_resumes_from_last_checkpoint_without_retraining(reef_server):
    server = reef_server("+recipe=sao", "+sao_profile=tiny", "trainer.checkpoint_every_n_versions=2", "seed=1")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    scenario = "durable"
    tasks = reef_sao_tasks.task_stream(seed=5)
    _report_tasks(server, client, scenario, tasks, 12)  # three batches of 4: live, checkpoint, live
    rows = wait_until(lambda: (c := _commits(server, scenario)) and len(c) >= 4 and c)
    assert [bool(r["release_id"]) for r in rows[:4]] == [True, False, True, False]  # creation first
    checkpoint = rows[2]["release_id"]
    consumed = {i for r in rows for i in r["consumed_ids"]}
    server.kill()
    server.start()
    status = wait_until(lambda: (s := httpx.get(f"{server.url}/reef/scenarios/{scenario}/status").json())
                   ["processor"]["records_ingested"] >= 24 and s)
    assert status["step"] == len(rows)  # the step counter survived
    assert status["current_release_id"] == checkpoint  # live versions after it were lost, by design
    assert status["current_version"].endswith(":1")  # a fresh incarnation, restored from the checkpoint
    assert status["processor"]["pending_units"] == 0  # nothing consumed came back
    _report_tasks(server, client, scenario, tasks, 4)
    after = wait_until(lambda: (c := _commits(server, scenario)) and len(c) > len(rows) and c)
    new = set(after[len(rows)]["consumed_ids"])
    assert len(new) == 8 and not new & consumed


def test_one_full_weight_training_scenario_per_process(reef_server):
    server = reef_server("+recipe=sao", "+sao_profile=tiny")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    _chat(client, "first", [{"role": "user", "content": "hello"}])  # binds the engine's weights to "first"
    _report_tasks(server, client, "second", reef_sao_tasks.task_stream(seed=7), 4)
    status = wait_until(lambda: (s := httpx.get(f"{server.url}/reef/scenarios/second/status").json())
                   ["records_seen"] >= 8 and s)
    assert "'first'" in status["training_disabled"]
    # It has its creation release (the base) and nothing trained.
    assert status["step"] == 1 and [c["operation"] for c in _commits(server, "second")] == ["creation"]
    assert httpx.get(f"{server.url}/reef/scenarios/first/status").json()["training_disabled"] is None


PROBE = [{"role": "user", "content": "spell the word banana backwards"}]


def _probe(server, client, scenario):
    """A greedy completion of a fixed prompt and the token record the server kept for it."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=PROBE, temperature=0, max_tokens=16, extra_headers={"x-reef-scenario": scenario})
    receipt = raw.headers["x-reef-agent-record-id"]
    detail = httpx.get(f"{server.url}/reef/scenarios/{scenario}/records/{receipt}").json()
    return raw.parse().choices[0].message.content or "", detail["payload"]["tokens"]


def test_rollback_of_weights_restores_exact_logprobs(reef_server):
    server = reef_server("+recipe=sao", "+sao_profile=tiny", "engine.seed=0", "seed=2",
                         "trainer.checkpoint_every_n_versions=1")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    scenario = "rewind"

    # A new weights scenario starts with release 0, the base model reference, serving its first records.
    text0, tokens0 = _probe(server, client, scenario)
    rows = _releases(server, scenario)
    assert [r["operation"] for r in rows] == ["creation"] and rows[0]["current"], server.log()[-3000:]
    creation = rows[0]["release_id"]
    assert rows[0]["metrics"]["serving_version"] == tokens0["version"]  # the record's version maps to it

    # One batch (4 reports) trains one release, which then serves.
    _report_tasks(server, client, scenario, reef_sao_tasks.task_stream(seed=11), 4)
    # The release row is written before the engine serves it: wait for its serving version (activation done).
    trained = wait_until(lambda: [r for r in _releases(server, scenario)
                                  if r["operation"] == "training" and "serving_version" in r["metrics"]], 300)
    assert len(trained) == 1, server.log()
    text1, tokens1 = _probe(server, client, scenario)
    assert tokens1["version"] == trained[0]["metrics"]["serving_version"] != tokens0["version"]
    moved = tokens1["output_ids"] != tokens0["output_ids"] or not torch.allclose(
        torch.tensor(tokens1["output_logprobs"]), torch.tensor(tokens0["output_logprobs"]), atol=1e-5)
    assert moved, "training left the probe's log-probs unchanged: the rollback check below would prove nothing"

    rolled = httpx.post(f"{server.url}/reef/scenarios/{scenario}/rollback", json={"release_id": creation})
    assert rolled.status_code == 200, rolled.text
    text2, tokens2 = _probe(server, client, scenario)
    assert tokens2["version"] not in (tokens0["version"], tokens1["version"])
    assert (text2, tokens2["output_ids"]) == (text0, tokens0["output_ids"])
    assert torch.allclose(torch.tensor(tokens2["output_logprobs"]), torch.tensor(tokens0["output_logprobs"]),
                          atol=1e-5)
    head = _releases(server, scenario)[0]
    assert head["operation"] == "rollback" and head["current"]
    assert head["release_id"] == rolled.json()["release_id"]
    assert head["metrics"]["serving_version"] == tokens2["version"]
    assert head["content_id"] == next(r["content_id"] for r in _releases(server, scenario)
                                      if r["release_id"] == creation)
    # After a restart (a new engine incarnation) the head serves under a new version; every record's
    # version, old or new, maps to a release of the chain.
    server.kill()
    server.start()
    text3, tokens3 = _probe(server, client, scenario)
    assert (text3, tokens3["output_ids"]) == (text0, tokens0["output_ids"])
    assert tokens3["version"].split(":")[0] != tokens2["version"].split(":")[0]
    mapped = {v: r["release_id"] for r in _releases(server, scenario) for v in r["metrics"].get("serving_versions", [])}
    served = {r["artifact_ref"] for r in _records(server, scenario) if r["request_type"] == "inference"}
    assert len(served) == 4 and served <= set(mapped), (served, mapped)
    assert mapped[tokens3["version"]] == mapped[tokens2["version"]] == head["release_id"]
    assert mapped[tokens0["version"]] == creation
