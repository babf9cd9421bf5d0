"""A composite release (harness + weights, the tiny model): one release holds both parts, a candidate changing one
part carries the other forward, a part that fails to activate leaves both as they were, and rollback restores both."""

from __future__ import annotations

import httpx
import pytest

from reef_core.config import compose_config
from reef_core.errors import ConfigError
from reef_core.grow.trainer import CandidateUpdate, Trainer
from reef_core.loop.assemble import build_deployment
from tests.grow.test_activation_failure import _commits, _releases, _status, _train_one_step

PIRATE, BAD = "Answer as a pirate.", "Answer badly."


def _lora_files(seed: int) -> dict[str, bytes]:
    """A random LoRA adapter of the tiny model as the weights part's files (``weights/adapter/...``)."""
    import json

    from safetensors.torch import save

    from reef_core.models.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    from reef_core.models.loading import build_tiny_model
    from reef_core.testing.adapters import random_adapter

    adapter, _ = random_adapter(build_tiny_model(seed=0)[0], seed)
    return {f"weights/{ADAPTER_CONFIG}": json.dumps(adapter.config).encode(),
            f"weights/{ADAPTER_WEIGHTS}": save({k: v.contiguous() for k, v in adapter.tensors.items()})}


class CompositeTrainer(Trainer):
    """Step 1: a LoRA adapter only (the creation's empty prompt is carried); step 2: a prompt only (the adapter is
    carried); step 3: a new prompt with weights that do not load (harness activates first, then weights fail)."""

    calls = 0

    def train(self, batch, ctx):
        self.calls += 1
        if self.calls == 1:
            return CandidateUpdate(files=_lora_files(1))
        if self.calls == 2:
            return CandidateUpdate(files={"harness/system_prompt.md": PIRATE.encode()})
        return CandidateUpdate(files={"weights/model.safetensors": b"not safetensors", "harness/system_prompt.md": BAD.encode()})


def _system_prompt(url: str, scenario: str) -> tuple[str, str]:
    answer = httpx.post(f"{url}/v1/chat/completions", headers={"x-reef-scenario": scenario}, timeout=60,
                        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 200, answer.text
    record = httpx.get(f"{url}/reef/scenarios/{scenario}/records/{answer.headers['x-reef-agent-record-id']}").json()
    first = record["payload"]["request"]["messages"][0]
    return (first["content"] if first["role"] == "system" else ""), answer.headers.get("x-reef-release-id")


def _greedy(url: str, scenario: str) -> str:
    """The reply to a fixed chat at temperature 0 (compared only between releases with the same prompt)."""
    answer = httpx.post(f"{url}/v1/chat/completions", headers={"x-reef-scenario": scenario}, timeout=60,
                        json={"model": "m", "temperature": 0, "max_tokens": 8,
                              "messages": [{"role": "user", "content": "hello there"}]})
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["message"]["content"]


def test_composite_release_activates_and_rolls_back_atomically(serve_trainer):
    trainer = CompositeTrainer()
    with serve_trainer("composite", lambda: trainer, "engine.kind=local", "engine.model=tiny",
                       "engine.max_new_tokens=4", "engine.seed=0", "recipe.processor=per_report",
                       "recipe.surfaces=[harness,weights]", "recipe.changes=[harness,weights]",
                       "+recipe.surface_options.harness.inject=system",
                       "+recipe.processor_options.batch_size=1") as url:
        s = "combo"
        base_reply = _greedy(url, s)
        first = _train_one_step(url, s, 1)[0]["release_id"]  # weights only: the empty prompt is carried
        assert _system_prompt(url, s) == ("", first)
        lora_reply = _greedy(url, s)
        assert lora_reply != base_reply  # the weights part serves: the adapter changed the greedy reply
        assert _releases(url, s)[0]["operation"] == "training"

        second = _train_one_step(url, s, 2)[1]["release_id"]  # a prompt only: the adapter is carried forward
        assert _system_prompt(url, s) == (PIRATE, second)

        commits = _train_one_step(url, s, 4)  # harness moved, then weights failed: harness restored
        assert [c["operation"] for c in commits[2:]] == ["training", "restore"]
        status = _status(url, s)
        assert status["counters"]["activation_failures"] == 1
        assert status["activation_error"]["release_id"] == commits[2]["release_id"]
        restored = commits[3]["release_id"]
        assert _system_prompt(url, s) == (PIRATE, restored)

        creation = next(r for r in _releases(url, s) if r["operation"] == "creation")["release_id"]
        rolled = httpx.post(f"{url}/reef/scenarios/{s}/rollback", json={"release_id": creation})
        assert rolled.status_code == 200, rolled.text
        prompt, served = _system_prompt(url, s)
        assert prompt == "" and served == rolled.json()["release_id"]  # no prompt, base weights: both parts
        assert _greedy(url, s) == base_reply
        assert _commits(url, s)[-1]["operation"] == "rollback"


@pytest.mark.parametrize("overrides, key", [
    (["recipe.surfaces=[harness,nope]"], "recipe.surfaces[1]"),
    (["recipe.surfaces=[harness,skills]", "recipe.changes=[weights]"], "recipe.changes"),
    (["recipe.surface=harness", "recipe.surfaces=[harness,skills]"], "recipe.surfaces"),
    (["recipe.surfaces=[harness]"], "recipe.surfaces"),
    (["recipe.surfaces=[harness,skills]", "+recipe.surface_options.weights.x=1"], "recipe.surface_options.weights"),
    (["recipe.surface=harness", "recipe.changes=[skills]"], "recipe.changes"),
])
def test_composite_config_errors_name_the_key(tmp_path, fake_upstream_url, overrides, key):
    cfg = compose_config(["engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                          f"storage.data_dir={tmp_path}", "recipe.name=c", *overrides])
    with pytest.raises(ConfigError) as caught:
        build_deployment(cfg)
    assert key in caught.value.message
