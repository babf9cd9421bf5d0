"""FakeSGLang keeps the protocol facts of SGLang's native API (sglang-protocol-notes.md) that Reef depends on."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from reef_core.testing import serve_asgi, wait_until
from reef_core.testing.fake_sglang import FakeSGLang


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    app = FakeSGLang(tiny_model_dir, max_loaded_loras=1)
    with serve_asgi(app) as url:
        yield app, url


@pytest.fixture
def fake(served):
    app, url = served
    app.token_delay_s = 0.0
    app._faults.clear()
    with httpx.Client(base_url=url, timeout=30) as client:
        yield app, client
        client.post("/continue_generation", json={})


def _gen(client, **kw):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, **kw}
    return client.post("/generate", json=body)


def test_generate_shapes_and_unknown_sampling_keys(fake):
    _app, client = fake
    out = _gen(client, return_logprob=True, top_logprobs_num=2).json()
    meta = out["meta_info"]
    assert len(out["output_ids"]) == meta["completion_tokens"] == len(meta["output_token_logprobs"])
    assert all(len(t) == 3 and t[1] == i for t, i in zip(meta["output_token_logprobs"], out["output_ids"]))
    assert all(len(row) == 2 for row in meta["output_top_logprobs"])
    assert meta["finish_reason"]["type"] in ("length", "stop") and "weight_version" in meta
    refused = client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_tokens": 4}})
    assert refused.status_code == 500  # as SGLang: an unknown sampling key fails inside the server


def test_streams_are_cumulative_and_end_with_done(fake):
    _app, client = fake
    with client.stream("POST", "/generate", json={"input_ids": [1, 2, 3], "stream": True,
                                                  "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    states = [json.loads(x) for x in lines[:-1]]
    assert [len(s["output_ids"]) for s in states] == [1, 2, 3, 4]
    assert all(states[i]["output_ids"] == states[-1]["output_ids"][:i + 1] for i in range(4))


def test_pause_holds_new_requests_and_abort_mode_ends_in_flight_ones(fake):
    app, client = fake
    assert client.post("/pause_generation").status_code == 422  # a JSON body is required
    assert client.post("/pause_generation", json={"mode": "in_place"}).json()["success"]
    done = {}
    arrived = app.stats["generate"]
    thread = threading.Thread(target=lambda: done.setdefault("r", _gen(client)))
    thread.start()
    wait_until(lambda: app.stats["generate"] > arrived, timeout=10)  # it arrived ...
    assert "r" not in done and not app.in_flight  # ... and waits at admission while paused
    client.post("/continue_generation", json={})
    thread.join(10)
    assert done["r"].status_code == 200

    app.token_delay_s = 0.05
    thread = threading.Thread(target=lambda: done.__setitem__("a", _gen(
        client, sampling_params={"max_new_tokens": 50, "ignore_eos": True})))
    thread.start()
    wait_until(lambda: app.in_flight, timeout=10)
    client.post("/pause_generation", json={"mode": "abort"})
    thread.join(10)
    assert done["a"].json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_disk_update_failure_keeps_weights_and_label(fake, tmp_path):
    app, client = fake
    before = app.weight_version
    bad = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path), "weight_version": "x:1"})
    assert bad.status_code == 400 and bad.json()["success"] is False and app.weight_version == before
    good = client.post("/update_weights_from_disk", json={"model_path": str(app.model_dir), "weight_version": "x:2"})
    assert good.json()["success"] and client.get("/model_info").json()["weight_version"] == "x:2"


def test_evicted_adapters_reload_implicitly_and_unknown_ones_fail(fake, tmp_path):
    import copy

    from peft import LoraConfig, get_peft_model

    app, client = fake
    for name in ("one", "two"):
        peft_model = get_peft_model(copy.deepcopy(app.model), LoraConfig(r=2, target_modules="all-linear"))
        peft_model.save_pretrained(tmp_path / name)
        loaded = client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(tmp_path / name)})
        assert loaded.json()["success"]
    assert app.loaded_adapters() == ["two"]  # max_loaded_loras=1 evicted "one"
    assert _gen(client, lora_path="one").status_code == 200 and app.loaded_adapters() == ["one"]
    assert _gen(client, lora_path="never").status_code == 400
    for name in ("one", "two"):
        assert client.post("/unload_lora_adapter", json={"lora_name": name}).json()["success"]
    assert client.post("/unload_lora_adapter", json={"lora_name": "one"}).status_code == 400
