"""FakeVLLM keeps the protocol facts of vLLM's OpenAI server that Reef depends on: token-id log-probs with the
sampled token added, ``return_token_ids``, delta streams, pause modes, dev-mode and runtime-LoRA gating."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from reef_core.testing import serve_asgi, wait_until
from reef_core.testing.fake_vllm import FakeVLLM


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    app = FakeVLLM(tiny_model_dir, max_logprobs=5)
    with serve_asgi(app) as url:
        yield app, url


@pytest.fixture
def fake(served):
    app, url = served
    app.token_delay_s = 0.0
    app._faults.clear()
    with httpx.Client(base_url=url, timeout=30) as client:
        yield app, client
        client.post("/resume", json={})


def _complete(client, app, **kw):
    body = {"model": app.served_model_name, "prompt": [1, 2, 3], "max_tokens": 4, **kw}
    return client.post("/v1/completions", json=body)


def test_completions_carry_token_ids_and_token_id_logprobs(fake):
    app, client = fake
    out = _complete(client, app, logprobs=2, return_tokens_as_token_ids=True, return_token_ids=True).json()
    choice = out["choices"][0]
    lps = choice["logprobs"]
    assert choice["prompt_token_ids"] == [1, 2, 3] and len(choice["token_ids"]) == out["usage"]["completion_tokens"]
    assert lps["tokens"] == [f"token_id:{i}" for i in choice["token_ids"]]
    for tid, lp, row in zip(choice["token_ids"], lps["token_logprobs"], lps["top_logprobs"]):
        assert row[f"token_id:{tid}"] == lp and len(row) in (2, 3)  # the sampled token is always there
    plain = _complete(client, app, logprobs=0).json()["choices"][0]
    assert "token_ids" not in plain and not plain["logprobs"]["tokens"][0].startswith("token_id:")
    assert _complete(client, app, logprobs=6).status_code == 400  # over --max-logprobs
    missing = _complete(client, app, model="tiny")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_streams_are_deltas_with_prompt_ids_first_and_end_with_done(fake):
    app, client = fake
    body = {"model": app.served_model_name, "prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True, "stream": True,
            "return_token_ids": True, "logprobs": 0}
    with client.stream("POST", "/v1/completions", json=body) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    choices = [json.loads(x)["choices"][0] for x in lines[:-1]]
    assert [len(c["token_ids"]) for c in choices] == [1, 1, 1, 1] and choices[-1]["finish_reason"] == "length"
    assert choices[0]["prompt_token_ids"] == [1, 2, 3] and all("prompt_token_ids" not in c for c in choices[1:])


def test_pause_wait_lets_in_flight_finish_and_abort_ends_them(fake):
    app, client = fake
    app.token_delay_s = 0.05
    done = {}
    thread = threading.Thread(target=lambda: done.setdefault("w", _complete(client, app, max_tokens=6,
                                                                               ignore_eos=True)))
    thread.start()
    wait_until(lambda: app.in_flight, timeout=10)
    assert client.post("/pause?mode=wait").json() == {"status": "paused"}  # returns once the request is done
    assert not app.in_flight
    thread.join(10)
    assert done["w"].json()["choices"][0]["finish_reason"] == "length" and client.get("/is_paused").json()["is_paused"]
    client.post("/resume", json={})
    thread = threading.Thread(target=lambda: done.setdefault("a", _complete(client, app, max_tokens=50,
                                                                               ignore_eos=True)))
    thread.start()
    wait_until(lambda: app.in_flight, timeout=10)
    client.post("/pause?mode=abort")
    thread.join(10)
    assert done["a"].json()["choices"][0]["finish_reason"] == "abort"


def test_reload_reads_the_given_directory_and_a_failed_worker_call_ends_the_engine(fake, tmp_path):
    """As vLLM 0.32: ``reload_weights(weights_path=...)`` loads a directory; ``update_config`` fails; after a failed
    worker call the next model step fails and the server goes down (every route fails), unless a reload succeeds
    first; ``revive`` stands for a restart."""
    app, client = fake
    rpc = client.post("/collective_rpc", json={"method": "reload_weights",
                                               "kwargs": {"weights_path": str(app.model_dir)}})
    assert rpc.json() == {"results": [None]} and app.load_path == app.model_dir
    assert client.post("/update_weight_version", json={"new_version": "x:2"}).json()["success"]
    assert client.get("/weight_info").json() == {"weight_version": "x:2"}
    try:
        failed = client.post("/collective_rpc", json={"method": "update_config",
                                                      "args": [{"model_config": {"model": str(tmp_path)}}]})
        assert failed.status_code == 500 and "_hf_config_revision" in failed.text
        assert client.get("/health").status_code == 200  # the API process answers until a step fails
        assert _complete(client, app).status_code == 500 and client.get("/health").status_code >= 500
        app.revive()
        client.post("/collective_rpc", json={"method": "update_config", "args": [{}]})
        healed = client.post("/collective_rpc", json={"method": "reload_weights",
                                                      "kwargs": {"weights_path": str(app.model_dir)}})
        assert healed.status_code == 200 and _complete(client, app).status_code == 200  # a reload first: it lives
        app.revive()
        assert client.get("/health").status_code == 200
        assert client.get("/weight_info").json() == {"weight_version": "default"}
        relative = client.post("/collective_rpc", json={"method": "reload_weights",
                                                        "kwargs": {"weights_path": tmp_path.name}})
        assert relative.status_code == 500 and "Repo id" in relative.text  # not a directory in the server's cwd
    finally:
        app.revive()


def test_adapter_routes_answer_text_and_refuse_duplicates_and_unknown_names(fake, tmp_path):
    import copy

    from peft import LoraConfig, get_peft_model

    app, client = fake
    get_peft_model(copy.deepcopy(app.model), LoraConfig(r=2, target_modules="all-linear")).save_pretrained(tmp_path)
    body = {"lora_name": "one", "lora_path": str(tmp_path)}
    loaded = client.post("/v1/load_lora_adapter", json=body)
    assert loaded.status_code == 200 and loaded.text.startswith("Success")
    assert client.post("/v1/load_lora_adapter", json=body).status_code == 400
    cards = client.get("/v1/models").json()["data"]
    assert {"id": "one", "parent": app.served_model_name}.items() <= next(c for c in cards if c["id"] == "one").items()
    assert _complete(client, app, model="one").status_code == 200
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "one"}).status_code == 200
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "one"}).status_code == 404


def test_dev_mode_and_runtime_lora_routes_exist_only_when_enabled(tiny_model_dir):
    with serve_asgi(FakeVLLM(tiny_model_dir, dev_mode=False, runtime_lora=False)) as url:
        with httpx.Client(base_url=url, timeout=30) as client:
            for path in ("/pause", "/collective_rpc", "/update_weight_version", "/v1/load_lora_adapter"):
                assert client.post(path, json={}).status_code == 404, path
            assert client.get("/weight_info").status_code == 404 and client.get("/health").status_code == 200


def test_a_reload_leaves_a_tied_output_head_on_its_old_weights_as_vllm_0_32_does(tiny_model_dir, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    app = FakeVLLM(tiny_model_dir)
    head = app.model.get_output_embeddings().weight.detach().clone()
    tensors = {k: v + 0.5 for k, v in load_file(str(tiny_model_dir / "model.safetensors")).items()}
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with serve_asgi(app) as url:
        rpc = httpx.post(f"{url}/collective_rpc", json={"method": "reload_weights",
                                                        "kwargs": {"weights_path": str(tmp_path)}})
    assert rpc.status_code == 200
    assert torch.equal(app.model.get_output_embeddings().weight, head)  # the head kept the base's
    assert not torch.equal(app.model.get_input_embeddings().weight, head)  # the embeddings moved
