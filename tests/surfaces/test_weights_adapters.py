"""The weights surface with LoRA scenarios: an adapter each on the engine's shared base, each on its own version line."""

from __future__ import annotations

import asyncio
import copy
import json
import threading

import pytest
import torch

from reef_core.models.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterWeights
from reef_core.engines.base import EngineRequest
from reef_core.engines.local import LocalEngine
from reef_core.errors import Conflict
from reef_core.models.loading import load_model
from reef_core.grow.torch_backend import policy_lag
from reef_core.surfaces.base import ServingPorts
from reef_core.observe.processors.eligibility import CROSS_INCARNATION, STALE, staleness_reason
from reef_core.surfaces.weights import WeightsSurface
from reef_core.versions import adapter_key

MESSAGES = [{"role": "user", "content": "Name a colour."}]


def _adapter(base, seed) -> AdapterWeights:
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    as_json = json.loads(json.dumps(config.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
    as_json["peft_type"] = "LORA"
    as_json["task_type"] = "CAUSAL_LM"
    return AdapterWeights(as_json, {k: v.clone() for k, v in get_peft_model_state_dict(model).items()})


def _files(adapter: AdapterWeights) -> dict[str, bytes]:
    from safetensors.torch import save

    return {ADAPTER_CONFIG: json.dumps(adapter.config).encode(),
            ADAPTER_WEIGHTS: save({k: v.contiguous() for k, v in adapter.tensors.items()})}


class Served:
    """A started LocalEngine on a loop of its own thread, and a weights surface driving it (what a server holds)."""

    def __init__(self, model_dir, incarnation):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = LocalEngine(model_dir, max_new_tokens=8, version=f"{incarnation}:0")
        self.run(self.engine.start())
        ports = ServingPorts(engine=self.engine, artifacts=None, run_async=self.run,
                             load_base_model=lambda: load_model(model_dir))
        self.surface = WeightsSurface(ports)

    def run(self, coroutine, timeout=120):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def logprobs(self, scenario):
        """Greedy reply of a request frozen on the scenario's serving version: (version, output ids, log-probs)."""
        frozen = self.surface.serving_version(scenario)
        body = {"model": "tiny", "messages": MESSAGES, "temperature": 0}
        res = self.run(self.engine.complete(EngineRequest("openai", "chat", body, {}, version=frozen)))
        return res.tokens.version, res.tokens.output_ids, res.tokens.output_logprobs

    def close(self):
        self.run(self.engine.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from reef_core.models.loading import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    model, _ = load_model(tiny_model_dir)
    return model.eval()


@pytest.fixture
def served(tiny_model_dir):
    s = Served(tiny_model_dir, "inc1")
    yield s
    s.close()


def test_two_lora_scenarios_each_serve_their_own_adapter_on_their_own_version_line(served, base, tiny_model_dir):
    surface, creation = served.surface, served.surface.creation_files()
    a1, a2, b1 = _adapter(base, 1), _adapter(base, 2), _adapter(base, 3)
    ka, kb = adapter_key("math-a"), adapter_key("math-b")
    for name in ("math-a", "math-b"):
        surface.claim(name, lora=True)
        surface.activate(name, f"{name}-0", files=lambda: creation)
    plain = served.logprobs("math-a")
    assert plain[0] == "inc1:0" and served.logprobs("math-b") == plain  # both start on the base

    surface.activate("math-a", "a-1", payload=a1)
    surface.activate("math-b", "b-1", payload=b1)
    surface.activate("math-a", "a-2", files=lambda: _files(a2))  # from a release's files, as a restore reads them
    assert surface.serving_version("math-a") == f"inc1.{ka}:2" and surface.serving_version("math-b") == f"inc1.{kb}:1"
    assert surface.release_of[f"inc1.{ka}:2"] == "a-2" and surface.release_of[f"inc1.{kb}:1"] == "b-1"
    on_a, on_b = served.logprobs("math-a"), served.logprobs("math-b")
    assert on_a[0] == f"inc1.{ka}:2" and on_b[0] == f"inc1.{kb}:1"
    assert len({tuple(plain[2]), tuple(on_a[2]), tuple(on_b[2])}) == 3
    assert served.engine.version == "inc1:0"  # the base never moved

    # a full-weight scenario cannot join: the refusal names the adapters' scenarios and the fix
    with pytest.raises(Conflict, match=r"'math-a', 'math-b'.*trainer\.lora=true"):
        surface.claim("full-c", lora=False)
    norm = {"model.norm.weight": torch.ones_like(base.state_dict()["model.norm.weight"]) * 2}
    with pytest.raises(Conflict, match="LoRA adapters of scenario"):
        surface.activate("full-c", "c-1", payload=norm)
    assert served.logprobs("math-a") == on_a and surface.owner is None

    # rollback of A to its start: the base again, on A's own line; B is untouched
    surface.activate("math-a", "a-3", files=lambda: creation)
    rolled = served.logprobs("math-a")
    assert rolled[0] == f"inc1.{ka}:3" and rolled[1:] == plain[1:]
    assert served.logprobs("math-b") == on_b

    # restart: a new engine incarnation restores each head from its files
    heads = {"math-a": _files(a2), "math-b": _files(b1)}
    again = Served(tiny_model_dir, "inc2")
    try:
        for name, files in heads.items():
            again.surface.claim(name, lora=True)
            again.surface.activate(name, f"{name}-head", files=lambda files=files: files)
        restored_a, restored_b = again.logprobs("math-a"), again.logprobs("math-b")
        assert restored_a[0] == f"inc2.{ka}:1" and restored_b[0] == f"inc2.{kb}:1"
        assert restored_b[1] == on_b[1] and restored_b[2] == pytest.approx(on_b[2], abs=1e-5)
        assert restored_a[2] != plain[2]
    finally:
        again.close()


def test_a_full_weight_owner_refuses_adapters(served, base):
    surface, creation = served.surface, served.surface.creation_files()
    surface.claim("full", lora=False)
    surface.activate("full", "f-0", files=lambda: creation)
    norm = {"model.norm.weight": torch.ones_like(base.state_dict()["model.norm.weight"]) * 2}
    surface.activate("full", "f-1", payload=norm)
    assert surface.serving_version("full") == "inc1:1"
    with pytest.raises(Conflict, match=r"'full' trains this engine's full weights.*trainer\.lora=true"):
        surface.claim("lora-a", lora=True)
    with pytest.raises(Conflict):
        surface.activate("lora-a", "a-1", payload=_adapter(base, 1))
    with pytest.raises(Conflict, match="one full-weight scenario per process"):
        surface.claim("full-2", lora=False)
    # another scenario's creation release does not pretend to serve the base while the owner moved it
    with pytest.raises(Conflict):
        surface.activate("full-2", "g-0", files=lambda: creation)
    assert served.engine.adapters() == {} and served.engine.version == "inc1:1"


def test_staleness_and_policy_lag_count_a_scenarios_own_updates():
    line = f"inc.{adapter_key('a')}"
    assert staleness_reason("inc:0", f"{line}:2", 2) is None  # the base is step 0 of every adapter line
    assert staleness_reason("inc:0", f"{line}:2", 1) == STALE
    assert staleness_reason(f"{line}:1", f"{line}:2", 1) is None
    assert staleness_reason(f"inc.{adapter_key('b')}:1", f"{line}:2", 5) == CROSS_INCARNATION
    assert staleness_reason("inc:1", f"{line}:2", 5) == CROSS_INCARNATION  # a full-weight version is no base
    assert staleness_reason("old:0", f"{line}:2", 5) == CROSS_INCARNATION
    assert policy_lag([["inc:0"], [f"{line}:1", f"{line}:2"], [f"inc.{adapter_key('b')}:1"]], f"{line}:2") == [2, 1]


def test_a_learner_claims_with_its_trainers_mode_and_a_full_weight_scenario_beside_adapters_does_not_train(tmp_path):
    from types import SimpleNamespace

    from reef_core.config.schema import EvaluationConfig, RecipeConfig, TrainerConfig
    from reef_core.loop.learner import ScenarioLearner
    from reef_core.loop.pool import LearnerPool
    from reef_core.loop.ports import LearnerPorts, LearnerSettings

    engine = SimpleNamespace(version="inc:0", swap_weights=lambda *a, **k: None)
    serving = ServingPorts(engine=engine, artifacts=None, run_async=None, load_base_model=None)
    surface = WeightsSurface(serving)
    pool = LearnerPool(workers=1)
    ports = LearnerPorts(serving=serving, records=None, create=None, notify=None, pool=pool)
    recipe = RecipeConfig(name="weights", trainer="torch", surface="weights")

    def learner(name, lora):
        settings = LearnerSettings(data_dir=tmp_path, seed=0, trainer=TrainerConfig(lora=lora),
                                   evaluation=EvaluationConfig())
        return ScenarioLearner(name, recipe, surface, ports, settings)

    try:
        assert learner("math-a", True).training_disabled is None
        assert learner("math-b", True).training_disabled is None
        refused = learner("full-c", False)
        assert "'math-a', 'math-b'" in refused.training_disabled and "trainer.lora=true" in refused.training_disabled
        assert refused.status()["training_disabled"] == refused.training_disabled
        assert surface.owner is None and set(surface.adapters) == {"math-a", "math-b"}
    finally:
        pool.close()
