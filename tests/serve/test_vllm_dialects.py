"""A Reef server (in this process) in front of FakeVLLM: OpenAI and Anthropic clients, plain and streamed, get answers
in their own dialect whose records hold the tokens and temperature-1 log-probs of the fake's real model; a deployment
without a weights recipe passes requests through the server's OpenAI route under its served name (no token data)."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
import torch

from reef_core.serve.process.server import serve_reef
from reef_core.testing import FakeVLLM, serve_asgi
from reef_core.testing.remote_checks import reference_logprobs

pytest.importorskip("reef_sao")

MESSAGES = [{"role": "user", "content": "Name a vowel."}]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from reef_core.testing import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def fake(tiny_model_dir):
    app = FakeVLLM(tiny_model_dir)
    with serve_asgi(app) as url:
        yield app, url


def _tokens(url: str, scenario: str, record_id: str) -> dict | None:
    return httpx.get(f"{url}/reef/scenarios/{scenario}/records/{record_id}").json()["payload"].get("tokens")


def test_both_dialects_plain_and_streamed_record_the_models_tokens(fake, tiny_model_dir, tmp_path):
    app, vllm_url = fake
    overrides = ["+recipe=sao", "+sao_profile=tiny", "engine.kind=vllm", f"engine.url={vllm_url}",
                 f"engine.model={tiny_model_dir}", f"storage.data_dir={tmp_path / 'data'}"]
    with serve_reef(overrides) as url:
        headers = {"x-reef-scenario": "dialects"}
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, default_headers=headers)
        ant = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, default_headers=headers)

        raw = oai.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=6)
        plain = _tokens(url, "dialects", raw.headers["x-reef-agent-record-id"])
        assert raw.parse().choices[0].message.content == app.tok.decode(
            [i for i in plain["output_ids"] if i not in app.eos], skip_special_tokens=True)

        chunks = list(oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, stream=True))
        receipt = next(c for c in chunks if getattr(c, "reef", None))  # the receipt chunk before [DONE]
        streamed = _tokens(url, "dialects", receipt.reef["agent_record_id"])

        raw_a = ant.messages.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=6)
        message = raw_a.parse()
        assert message.type == "message" and message.role == "assistant"
        anthropic_plain = _tokens(url, "dialects", raw_a.headers["x-reef-agent-record-id"])

        with ant.messages.stream(model="tiny", messages=MESSAGES, max_tokens=6) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert final.stop_reason in ("end_turn", "max_tokens") and isinstance(text, str)

    for tokens in (plain, streamed, anthropic_plain):
        assert tokens is not None and tokens["version"].endswith(":0")
        chosen, _ = reference_logprobs(app.model, tokens["prompt_ids"], tokens["output_ids"])
        assert torch.allclose(chosen, torch.tensor(tokens["output_logprobs"]), atol=1e-4)
    assert plain["prompt_ids"] == streamed["prompt_ids"] == anthropic_plain["prompt_ids"]


def test_a_deployment_without_a_weights_recipe_passes_through(fake, tiny_model_dir, tmp_path):
    app, vllm_url = fake
    overrides = ["engine.kind=vllm", f"engine.url={vllm_url}", f"engine.model={tiny_model_dir}",
                 f"storage.data_dir={tmp_path / 'data'}"]
    with serve_reef(overrides) as url:
        before = dict(app.stats)
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                            default_headers={"x-reef-scenario": "plain"})
        raw = oai.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=4)
        assert raw.parse().choices[0].message.role == "assistant"
        assert _tokens(url, "plain", raw.headers["x-reef-agent-record-id"]) is None
    assert app.stats["chat"] == before["chat"] + 1 and app.stats["completions"] == before["completions"]
    assert app.log[-1]["body"]["model"] == str(tiny_model_dir)
