"""The weights surface: publish model weights into the embedded engine between requests.

Versions are ``<incarnation>:<sequence>``: the incarnation is fixed when the engine starts, the
sequence grows with every swap. The engine swaps on its worker thread after the requests already
submitted, so a request that started on version v finishes on v and the next one gets v+1.
One process trains at most one full-weight scenario: the engine has one set of weights.

A scenario's first release (``creation``) holds no weights: ``base.json`` names the base model the
engine loaded and a digest of its files (:func:`base_reference`). Activating it restores the base
weights (a no-op while the engine still serves them), so a rollback to the start works and the
version a scenario's first records name maps to a release.

Devices: a trainer's payload lives on ``trainer.device`` and a release's files load on the CPU; the
engine copies each tensor onto its own ``engine.device`` when it swaps, so the two may differ.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ..errors import ConfigError, Conflict, ValidationFailed
from .base import Surface

if TYPE_CHECKING:
    from ..loop.ports import ServingPorts

log = logging.getLogger("reef.surfaces")

#: The files that carry a weights release (written by ``reef_core.grow.torch_backend``).
MODEL_FILE = "model.safetensors"
ADAPTER_DIR = "adapter"
ADAPTER_WEIGHTS = f"{ADAPTER_DIR}/adapter_model.safetensors"
ADAPTER_CONFIG = f"{ADAPTER_DIR}/adapter_config.json"


#: The file of a creation release: the base model it stands for (no weights are copied).
BASE_REFERENCE = "base.json"


def model_digest(model_dir: Path) -> str:
    """``sha256:<hex>`` over every file of a model directory (relative path and bytes, in path order)."""
    digest = hashlib.sha256()
    root = Path(model_dir)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
        digest.update(b"\0")
    return f"sha256:{digest.hexdigest()}"


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


def state_dict_from_files(files: Mapping[str, bytes], load_base_model: Callable[[], tuple[Any, Any]] | None):
    """The full state dict a release's files describe: a full checkpoint, or base + a PEFT adapter."""
    from safetensors.torch import load as load_safetensors

    if base_reference(files) is not None:
        if load_base_model is None:
            raise ConfigError("a creation release needs the base model to be restored")
        return load_base_model()[0].state_dict()
    if MODEL_FILE in files:
        return load_safetensors(files[MODEL_FILE])
    if ADAPTER_WEIGHTS in files:
        import json
        import tempfile
        from pathlib import Path

        from peft import PeftModel

        if load_base_model is None:
            raise ConfigError("a LoRA release needs the base model to be restored")
        base, _tok = load_base_model()
        with tempfile.TemporaryDirectory() as tmp:
            adapter = Path(tmp) / "adapter"
            adapter.mkdir()
            for name, data in files.items():
                if name.startswith("adapter/"):
                    (Path(tmp) / name).write_bytes(data)
            json.loads((adapter / "adapter_config.json").read_text())  # must be valid
            merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
        return merged.state_dict()
    raise ConfigError("release has no weights (model.safetensors or adapter/adapter_model.safetensors)")


class WeightsSurface(Surface):
    kind = "weights"

    def __init__(self, ports: ServingPorts, options: Mapping[str, Any] | None = None):
        engine = ports.engine
        if not hasattr(engine, "swap_weights"):
            raise ConfigError(f"the weights surface needs an engine that can swap weights (engine.kind=local), "
                              f"not {getattr(engine, 'name', type(engine).__name__)!r}")
        self.ports = ports
        self.engine = engine
        incarnation, _, seq = str(engine.version).rpartition(":")
        self.incarnation = incarnation or str(engine.version)
        self.sequence = int(seq) if seq.isdigit() else 0
        self.owner: str | None = None
        self.release_of: dict[str, str] = {}
        self._lock = threading.Lock()
        self._digest: str | None = None  # of the base model's files, computed once
        self._on_base = True  # the engine holds the weights it loaded (no release swapped in yet)

    def base_digest(self) -> str:
        if self._digest is None:
            self._digest = model_digest(self.engine.model_dir)
        return self._digest

    def creation_files(self) -> Mapping[str, Any]:
        """``base.json``: the base model's name and digest (a reference, not a copy of the weights)."""
        ref = {"model": str(getattr(self.engine, "name", "")), "digest": self.base_digest()}
        return {BASE_REFERENCE: (json.dumps(ref, sort_keys=True, indent=1) + "\n").encode()}

    def claim(self, scenario: str) -> None:
        """Make ``scenario`` the one whose training moves the engine's weights (first come, first served)."""
        with self._lock:
            self._claim(scenario)

    def _claim(self, scenario: str) -> None:
        if self.owner is None:
            self.owner = scenario
        elif self.owner != scenario:
            raise Conflict(f"this process already trains the weights of scenario {self.owner!r}; one full-weight "
                           f"scenario per process (start another deployment for {scenario!r})")

    def validate(self, files) -> None:
        """A weights release must name its weights: a full checkpoint or a PEFT adapter with its config.

        Only names are checked: a trainer's files are serialised lazily (between checkpoints never), so
        whether the bytes load is found out at activation, which restores the head when they do not."""
        names = set(files or ())
        if MODEL_FILE in names:
            return
        if ADAPTER_WEIGHTS in names:
            if ADAPTER_CONFIG not in names:
                raise ValidationFailed(f"a LoRA weights release needs {ADAPTER_CONFIG} beside {ADAPTER_WEIGHTS}")
            return
        raise ValidationFailed(f"a weights release holds {MODEL_FILE} or {ADAPTER_WEIGHTS}; got "
                               f"{', '.join(sorted(names)[:5]) or 'no files'}")

    def activate(self, scenario, release_id, payload=None, files=None) -> None:
        with self._lock:
            self._claim(scenario)
            contents = files() if payload is None else None
            ref = base_reference(contents) if contents is not None else None
            if ref is not None and ref["digest"] != self.base_digest():
                raise ConfigError(f"release {release_id} of scenario {scenario!r} names base model "
                                  f"{ref.get('model')!r} ({ref['digest']}), but the engine loaded "
                                  f"{getattr(self.engine, 'name', '?')!r} ({self.base_digest()})")
            if ref is not None and self._on_base:
                # The engine already serves the base: its current version is this release (no swap, no new version).
                version = str(self.engine.version)
            else:
                state = payload if payload is not None else state_dict_from_files(contents, self.ports.load_base_model)
                version = f"{self.incarnation}:{self.sequence + 1}"
                self.ports.run_async(self.engine.swap_weights(version, state))
                self.sequence += 1
                self._on_base = ref is not None  # only once the swap succeeded
            self.release_of[version] = release_id
            log.info("scenario %s now served by %s (release %s)", scenario, version, release_id)

    def serving_version(self, scenario: str) -> str | None:
        return str(self.engine.version)
