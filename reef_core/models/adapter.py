"""A LoRA adapter as the local engine loads it: its PEFT config and its own tensors (never merged weights).

The trainer hands one over as a LoRA step's payload; a release stores the same thing as
``adapter/adapter_config.json`` + ``adapter/adapter_model.safetensors`` (:meth:`AdapterWeights.from_files`).
Tensor keys are those of ``peft.get_peft_model_state_dict`` (no adapter name in them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reef_core.errors import ValidationFailed

ADAPTER_DIR = "adapter"
ADAPTER_WEIGHTS = f"{ADAPTER_DIR}/adapter_model.safetensors"
ADAPTER_CONFIG = f"{ADAPTER_DIR}/adapter_config.json"


@dataclass(frozen=True)
class AdapterWeights:
    """``config``: the ``adapter_config.json`` object; ``tensors``: the adapter's state dict."""

    config: dict
    tensors: Mapping[str, Any]

    def __post_init__(self) -> None:
        if not isinstance(self.config, dict) or str(self.config.get("peft_type", "")).upper() != "LORA":
            raise ValidationFailed("an adapter's config must be a LoRA adapter_config (peft_type LORA)")
        if not self.tensors:
            raise ValidationFailed("an adapter holds no tensors")

    @classmethod
    def from_files(cls, files: Mapping[str, Any]) -> "AdapterWeights":
        """The adapter a release's ``adapter/`` files hold (bytes of the config and the safetensors file)."""
        from safetensors.torch import load

        try:
            raw = files[ADAPTER_CONFIG]
            config = json.loads(raw.decode() if isinstance(raw, (bytes, bytearray)) else raw)
            tensors = load(bytes(files[ADAPTER_WEIGHTS]))
        except KeyError as exc:
            raise ValidationFailed(f"a LoRA release needs {exc.args[0]}") from None
        except (UnicodeDecodeError, ValueError) as exc:
            raise ValidationFailed(f"a LoRA release's adapter files do not load: {exc}") from None
        except Exception as exc:  # safetensors raises its own error type for corrupt bytes
            raise ValidationFailed(f"{ADAPTER_WEIGHTS} does not load: {exc}") from None
        return cls(config, tensors)
