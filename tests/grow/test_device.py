"""Device resolution (``engine.device``, ``trainer.device``): the rules, on this CPU-only machine and on a
simulated GPU machine (only the resolution function is fooled; nothing runs on a GPU)."""

from __future__ import annotations

import pytest
import torch

from reef_core.config.schema import EngineConfig, ReefConfig, TrainerConfig
from reef_core.errors import ConfigError
from reef_core.models.device import available_devices, check_devices, resolve_device, trainer_device

needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(),
                                    reason="asserts what a CPU-only machine resolves")


@pytest.fixture
def two_gpus(monkeypatch):
    """Make the resolver believe the machine has two CUDA devices."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@needs_cpu_only
def test_cpu_only_machine():
    assert available_devices() == ["cpu"]
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cpu") == "cpu"
    assert resolve_device(" CPU ") == "cpu"
    for spec in ("cuda", "cuda:0", "cuda:7"):
        with pytest.raises(ConfigError) as err:
            resolve_device(spec, field="engine.device")
        assert f"engine.device={spec}" in err.value.message
        assert "CUDA is not available" in err.value.message and "available: cpu" in err.value.message
    with pytest.raises(ConfigError, match=r"engine.device=mps .*MPS is not available"):
        resolve_device("mps")


@pytest.mark.parametrize("spec", ["gpu", "cpu:0", "mps:0", "cuda:", "cuda:-1", "cuda:x", "", "  ", None, 0, ["cpu"]])
def test_malformed_specs_are_refused_naming_the_field(spec):
    with pytest.raises(ConfigError) as err:
        resolve_device(spec, field="trainer.device")
    assert err.value.message.startswith("trainer.device must be one of auto, cpu, cuda, cuda:N, mps")


def test_simulated_gpu_machine(two_gpus):
    assert available_devices()[:3] == ["cpu", "cuda:0", "cuda:1"]
    assert resolve_device("auto") == "cuda:0"
    assert resolve_device("cuda") == "cuda:0"
    assert resolve_device("cuda:1") == "cuda:1"
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ConfigError) as err:
        resolve_device("cuda:2", field="engine.device")
    assert "engine.device=cuda:2" in err.value.message and "this machine has 2 CUDA devices" in err.value.message
    assert "cuda:0, cuda:1" in err.value.message


def test_trainer_device_follows_the_engine_unless_set(two_gpus):
    assert TrainerConfig().device is None
    assert trainer_device(TrainerConfig(), EngineConfig(device="cuda:1")) == "cuda:1"
    assert trainer_device(TrainerConfig(), EngineConfig(device="auto")) == "cuda:0"
    assert trainer_device(TrainerConfig(device="cpu"), EngineConfig(device="cuda:1")) == "cpu"
    with pytest.raises(ConfigError, match=r"^trainer.device=cuda:5 "):
        trainer_device(TrainerConfig(device="cuda:5"), EngineConfig(device="cpu"))


def test_check_devices_covers_what_the_deployment_uses():
    cfg = ReefConfig(engine=EngineConfig(kind="local", device="cpu"))
    assert check_devices(cfg) == {"engine": "cpu", "trainer": "cpu"}
    # An upstream engine has no device: its engine.device is not checked, an explicit trainer.device is.
    upstream = ReefConfig(engine=EngineConfig(kind="upstream", device="bogus"))
    assert check_devices(upstream) == {}
    upstream.trainer.device = "tpu"
    with pytest.raises(ConfigError, match=r"^trainer.device must be one of"):
        check_devices(upstream)
    with pytest.raises(ConfigError, match=r"^engine.device must be one of"):
        check_devices(ReefConfig(engine=EngineConfig(kind="local", device="bogus")))


def test_the_learner_hands_trainers_the_local_engines_device():
    from reef_core.loop.learner import _device_of

    class Local:
        device = torch.device("cpu")

    assert _device_of(Local()) == "cpu"
    assert _device_of(object()) is None  # an upstream engine has no device
