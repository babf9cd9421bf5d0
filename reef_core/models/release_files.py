"""The files a weights release holds, named once for the surface that writes them and the trainers that read them.

A full-weight release holds :data:`MODEL_FILE` (plus the model's config and tokenizer files); a LoRA release holds
``adapter/`` (:data:`~reef_core.models.adapter.ADAPTER_CONFIG`, :data:`~reef_core.models.adapter.ADAPTER_WEIGHTS`);
a scenario's first release (``creation``) holds only :data:`BASE_REFERENCE`, naming the base model it stands for.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..errors import ValidationFailed
from .adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "BASE_REFERENCE", "MODEL_FILE", "base_reference"]

#: A full-weight release's checkpoint (safetensors).
MODEL_FILE = "model.safetensors"

#: The file of a creation release: the base model it stands for (no weights are copied).
BASE_REFERENCE = "base.json"


def base_reference(files: Mapping[str, Any]) -> dict | None:
    """The base model a creation release names (``{"model", "digest"}``), or None for a weights release."""
    if BASE_REFERENCE not in files:
        return None
    raw = files[BASE_REFERENCE]
    try:
        ref = json.loads(raw.decode() if isinstance(raw, (bytes, bytearray)) else raw)
    except (UnicodeDecodeError, ValueError):
        raise ValidationFailed(f"{BASE_REFERENCE} is not valid JSON") from None
    if not isinstance(ref, dict) or not isinstance(ref.get("digest"), str):
        raise ValidationFailed(f"{BASE_REFERENCE} must be an object with a digest")
    return ref
