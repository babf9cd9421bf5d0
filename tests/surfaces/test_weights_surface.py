"""The weights surface validates a candidate by the names of its files (never forcing lazy serialisation)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from reef_core.errors import ValidationFailed
from reef_core.surfaces.weights import WeightsSurface


class _Engine:
    version = "inc:0"

    async def swap_weights(self, version, state_dict=None):  # pragma: no cover - never called here
        raise AssertionError("validation must not swap")


class _Unreadable(dict):
    """Files whose bytes must not be read by validation (a trainer serialises them lazily)."""

    def __getitem__(self, name):
        raise AssertionError(f"validation read {name}")


@pytest.fixture
def surface():
    return WeightsSurface(SimpleNamespace(engine=_Engine()))


def test_full_checkpoint_and_lora_adapter_pass_without_reading_bytes(surface):
    surface.validate(_Unreadable({"model.safetensors": b"", "config.json": b""}))
    surface.validate(_Unreadable({"adapter/adapter_model.safetensors": b"", "adapter/adapter_config.json": b""}))


@pytest.mark.parametrize("files, message", [
    ({}, "no files"),
    ({"notes.txt": b"x"}, "notes.txt"),
    ({"adapter/adapter_model.safetensors": b""}, "adapter_config.json"),
])
def test_release_without_weights_is_refused(surface, files, message):
    with pytest.raises(ValidationFailed, match=message):
        surface.validate(files)
