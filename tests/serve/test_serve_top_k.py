"""`reef serve engine.top_k_logprobs=K`: every local-engine record carries its packed top-K, plain and streamed."""

from __future__ import annotations

import sqlite3

import httpx
import openai

from reef_core.topk import TopK


def _stored_top_k(server, receipt: str) -> bytes | None:
    db = sqlite3.connect(server.data_dir / "records.db")
    try:
        return db.execute("SELECT top_k FROM records WHERE record_id = ?", (receipt,)).fetchone()[0]
    finally:
        db.close()


def test_records_carry_top_k_when_configured_and_nothing_when_off(reef_server):
    server = reef_server("engine.kind=local", "engine.model=tiny", "engine.max_new_tokens=10", "engine.seed=0",
                         "engine.top_k_logprobs=5")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], extra_headers={"x-reef-scenario": "topk"})
    receipt = raw.headers["x-reef-agent-record-id"]
    record = httpx.get(f"{server.url}/reef/scenarios/topk/records/{receipt}").json()
    tokens = record["payload"]["tokens"]
    assert "top_k" not in tokens  # never as JSON in the payload
    top = TopK.unpack(_stored_top_k(server, receipt))
    assert top.k == 5 and top.tokens == len(tokens["output_ids"])
    for t, (tid, lp) in enumerate(zip(tokens["output_ids"], tokens["output_logprobs"])):
        ids, lps = top.row(t)
        assert lps == sorted(lps, reverse=True) and (tid not in ids or abs(lps[ids.index(tid)] - lp) < 1e-2)

    stream = client.chat.completions.create(model="tiny", stream=True, messages=[{"role": "user", "content": "hi"}],
                                            extra_headers={"x-reef-scenario": "topk"})
    receipt = list(stream)[-1].model_extra["reef"]["agent_record_id"]
    streamed = httpx.get(f"{server.url}/reef/scenarios/topk/records/{receipt}").json()["payload"]["tokens"]
    assert TopK.unpack(_stored_top_k(server, receipt)).tokens == len(streamed["output_ids"])


def test_default_config_stores_no_top_k(module_reef_server):
    server = module_reef_server("engine.kind=local", "engine.model=tiny", "engine.max_new_tokens=6")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], extra_headers={"x-reef-scenario": "plain"})
    assert _stored_top_k(server, raw.headers["x-reef-agent-record-id"]) is None
