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


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
def test_a_flushing_update_kills_the_server_unless_the_pause_left_no_request(tiny_model_dir, mode):
    app = FakeSGLang(tiny_model_dir)
    app.token_delay_s = 0.05
    with serve_asgi(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        done = {}
        thread = threading.Thread(target=lambda: done.setdefault("r", _gen(
            client, sampling_params={"max_new_tokens": 200, "ignore_eos": True})))
        thread.start()
        wait_until(lambda: app.in_flight, timeout=10)
        assert client.post("/pause_generation", json={"mode": mode}).status_code == 200
        update = client.post("/update_weights_from_disk", json={"model_path": str(app.model_dir)})
        if mode == "abort":  # the pause returned once the request had ended: nothing blocks the flush
            assert update.json()["success"] and app.crashed is None
            client.post("/continue_generation", json={})
            thread.join(10)
            assert done["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
        else:  # in_place keeps it running, retract parks it in the waiting queue: the flush fails
            assert update.status_code == 500 and "Cache flush failed" in app.crashed
            assert client.get("/health").status_code == 503
            thread.join(10)
            assert done["r"].status_code == 500 or done["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_incremental_streaming_output_sends_only_what_is_new(tiny_model_dir):
    body = {"input_ids": [1, 2, 3], "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 5, "ignore_eos": True, "temperature": 0}}
    chunks = {}
    for incremental in (False, True):
        app = FakeSGLang(tiny_model_dir, incremental_streaming_output=incremental)
        with serve_asgi(app) as url, httpx.Client(base_url=url, timeout=30) as client:
            assert client.get("/server_info").json()["incremental_streaming_output"] is incremental
            with client.stream("POST", "/generate", json=body) as r:
                chunks[incremental] = [json.loads(line[6:]) for line in r.iter_lines()
                                       if line.startswith("data: ") and line != "data: [DONE]"]
    full, deltas = chunks[False][-1], chunks[True]
    assert [len(c["output_ids"]) for c in deltas] == [1, 1, 1, 1, 1]
    assert sum((c["output_ids"] for c in deltas), []) == full["output_ids"]
    assert "".join(c["text"] for c in deltas) == full["text"]
    assert sum((c["meta_info"]["output_token_logprobs"] for c in deltas), []) == \
        full["meta_info"]["output_token_logprobs"]


def test_seeds_count_only_with_deterministic_inference_and_must_fit_int32(tiny_model_dir):
    assert FakeSGLang(tiny_model_dir)._params({"sampling_seed": 7})["seed"] is None
    app = FakeSGLang(tiny_model_dir, deterministic_inference=True)
    with serve_asgi(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        sp = {"max_new_tokens": 8, "ignore_eos": True, "temperature": 1.0, "sampling_seed": 5}
        first, again = (_gen(client, sampling_params=sp).json()["output_ids"] for _ in range(2))
        assert first == again
        assert _gen(client, sampling_params={**sp, "sampling_seed": 2 ** 31 - 1}).status_code == 200
        assert _gen(client, sampling_params={**sp, "sampling_seed": 2 ** 31}).status_code == 500
        assert "int32" in app.crashed and _gen(client).status_code == 500


def test_relative_paths_resolve_against_the_servers_working_directory(tiny_model_dir, tmp_path):
    import shutil

    shutil.copytree(tiny_model_dir, tmp_path / "release")
    app = FakeSGLang(tiny_model_dir, cwd=tmp_path)
    with serve_asgi(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert client.post("/update_weights_from_disk", json={"model_path": "release"}).json()["success"]
        assert client.post("/update_weights_from_disk", json={"model_path": "elsewhere"}).status_code == 400


def test_input_token_logprobs_from_logprob_start_len(tiny_model_dir):
    import torch

    app = FakeSGLang(tiny_model_dir)
    ids = [5, 9, 2, 7]
    with serve_asgi(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        meta = _gen(client, input_ids=ids, return_logprob=True, logprob_start_len=0).json()["meta_info"]
        assert _gen(client, input_ids=ids, return_logprob=True).json()["meta_info"]["input_token_logprobs"] == []
    rows = meta["input_token_logprobs"]
    assert [r[1] for r in rows] == ids and rows[0][0] is None
    with torch.no_grad():
        logp = torch.log_softmax(app.model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    assert all(abs(rows[i][0] - float(logp[i - 1, ids[i]])) < 1e-4 for i in range(1, len(ids)))
