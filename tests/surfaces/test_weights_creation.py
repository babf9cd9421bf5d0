"""The weights surface's creation release: a reference to the base model, restored on activation."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from reef_core.errors import ConfigError
from reef_core.models.loading import ensure_tiny_model, load_model
from reef_core.surfaces.base import ServingPorts
from reef_core.surfaces.weights import BASE_REFERENCE, WeightsSurface, base_reference, model_digest


class SwapEngine:
    """The part of the local engine the surface drives: a model, its version and ``swap_weights``."""

    def __init__(self, model_dir):
        self.model_dir = model_dir
        self.name = model_dir.name
        self.version = "inc:0"
        self.model, _ = load_model(model_dir)
        self.swaps: list[str] = []

    async def swap_weights(self, version, state_dict=None):
        own = self.model.state_dict()
        with torch.no_grad():
            for k, v in (state_dict or {}).items():
                own[k].copy_(v)
        self.version = version
        self.swaps.append(version)


@pytest.fixture
def surface(tmp_path):
    model_dir = ensure_tiny_model(tmp_path / "tiny")
    engine = SwapEngine(model_dir)
    ports = ServingPorts(engine=engine, artifacts=None, run_async=asyncio.run,
                         load_base_model=lambda: load_model(model_dir))
    return WeightsSurface(ports)


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_creation_files_name_the_base_and_its_digest_not_its_weights(surface):
    files = surface.creation_files()
    assert list(files) == [BASE_REFERENCE] and len(files[BASE_REFERENCE]) < 1024
    ref = base_reference(files)
    assert ref == {"model": "tiny", "digest": model_digest(surface.engine.model_dir)}
    assert ref["digest"].startswith("sha256:") and len(ref["digest"]) == 7 + 64


def test_warm_computes_the_digest_a_first_scenario_names_once(surface, monkeypatch):
    from reef_core.surfaces import weights

    calls = []
    monkeypatch.setattr(weights, "model_digest", lambda path: calls.append(path) or model_digest(path))
    surface.warm()  # at start-up, off the request path
    ref = base_reference(surface.creation_files())  # a new scenario's first request
    assert calls == [surface.engine.model_dir] and ref["digest"] == model_digest(surface.engine.model_dir)


def test_activating_the_base_swaps_only_when_the_engine_left_it(surface):
    engine, files = surface.engine, surface.creation_files()
    base = _weights(engine.model)
    surface.activate("s", "rel-0", files=lambda: files)
    assert engine.swaps == [] and surface.release_of == {"inc:0": "rel-0"}  # the first records' version maps
    trained = {k: v + 0.5 for k, v in base.items() if k.endswith("norm.weight")}
    surface.activate("s", "rel-1", payload=trained)
    assert engine.version == "inc:1" and not torch.equal(engine.model.state_dict()[next(iter(trained))],
                                                         base[next(iter(trained))])
    surface.activate("s", "rel-2", files=lambda: files)  # a rollback to the start
    assert engine.version == "inc:2" and surface.release_of["inc:2"] == "rel-2"
    assert all(torch.equal(v, base[k]) for k, v in engine.model.state_dict().items())
    surface.activate("s", "rel-3", files=lambda: files)  # already the base: nothing to swap
    assert engine.swaps == ["inc:1", "inc:2"] and surface.release_of["inc:2"] == "rel-3"


def test_a_creation_release_of_another_base_is_refused(surface):
    other = {BASE_REFERENCE: json.dumps({"model": "tiny", "digest": "sha256:" + "0" * 64}).encode()}
    with pytest.raises(ConfigError, match="names base model"):
        surface.activate("s", "rel-0", files=lambda: other)
    assert surface.engine.swaps == [] and surface.release_of == {}
