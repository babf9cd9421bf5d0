"""The weights surface: publish model weights into the embedded engine between requests.

The same surface drives an SGLang or vLLM server (``engine.kind=sglang`` / ``vllm``):
:class:`~reef_core.engines.remote.RemoteEngine` implements ``swap_weights``, ``load_adapter`` and ``drop_adapter`` over
HTTP with the same semantics (see there).

Two kinds of weights scenario, never both on one engine:

* **Full weights**: versions are ``<incarnation>:<sequence>``: the incarnation is fixed when the engine starts,
  the sequence grows with every swap. One process trains at most one full-weight scenario (the ``owner``): the
  engine has one set of weights.
* **LoRA adapters**: any number of scenarios, each served by its own adapter kept unmerged on the shared base
  (``LocalEngine.load_adapter``). Each has its own version line ``<incarnation>.<key>:<sequence>`` (``key``:
  :func:`~reef_core.versions.adapter_key`), so staleness and policy lag count only that scenario's updates; before its first adapter
  it is served by the base under the engine's version (sequence 0 of every line, see
  ``reef_core.observe.processors.eligibility``).

A full-weight swap would move the base under every adapter, so the kinds exclude each other: the learner
claims (:meth:`~WeightsSurface.claim`) each training scenario with its trainer's mode (``trainer.lora``) and the
second kind is refused with a :class:`Conflict` naming the scenarios and the fix (that scenario does not train; its
status says why). A release's own form decides at activation too (an adapter payload or ``adapter/`` files are a
LoRA release; the full-weight owner's adapter files are merged into its weights).

The engine switches on its worker thread after the requests already submitted, so a request that started on
version v finishes on v and the next one gets the next version.

A scenario's first release (``creation``) holds no weights: ``base.json`` names the base model the
engine loaded and a digest of its files (:func:`base_reference`). Activating it restores the base
weights (a no-op while the engine still serves them; for a LoRA scenario that has served an adapter, the base on
the scenario's own line), so a rollback to the start works and the version a scenario's first records name maps to
a release. Restart: the learner activates each scenario's head release from its files, which reloads every LoRA
scenario's adapter under the new incarnation.

Devices: a trainer's payload lives on ``trainer.device`` and a release's files load on the CPU; the
engine copies each tensor onto its own ``engine.device`` when it loads it, so the two may differ.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, Callable, Mapping

from ..models.adapter import AdapterWeights
from ..models.digest import model_digest
from ..models.release_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_REFERENCE, MODEL_FILE, base_reference
from ..errors import ConfigError, Conflict, ValidationFailed
from ..versions import ServedVersion, adapter_key
from ..engines.capabilities import AdapterSink, WeightSink
from .base import ServingPorts, Surface

log = logging.getLogger("reef.surfaces")

#: The files that carry a weights release (written by ``reef_core.grow.torch_backend``).
__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "BASE_REFERENCE", "MODEL_FILE", "WeightsSurface"]


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
    """Weights releases into the embedded engine: one full-weight scenario, or any number of LoRA scenarios.

    See the module docstring for versions and the rule that full weights and adapters do not share an engine."""

    kind = "weights"

    def __init__(self, ports: ServingPorts, options: Mapping[str, Any] | None = None):
        engine = ports.engine
        if not isinstance(engine, WeightSink):
            raise ConfigError(f"the weights surface needs an engine that can swap weights (engine.kind=local, sglang or vllm), "
                              f"not {getattr(engine, 'name', type(engine).__name__)!r}")
        self.ports = ports
        self.engine = engine
        served = ServedVersion.read(str(engine.version))
        self.incarnation = served.incarnation
        self.sequence = served.seq
        #: The scenario whose training moves the engine's own weights (full weights), or None.
        self.owner: str | None = None
        #: LoRA scenarios -> the sequence of their own version line (0: no adapter loaded yet in this process).
        self.adapters: dict[str, int] = {}
        self._on_line: dict[str, bool] = {}  # LoRA scenario -> it serves a version of its own line now
        self.release_of: dict[str, str] = {}
        self._lock = threading.Lock()
        self._digest: str | None = None  # of the base model's files, computed once
        self._digest_lock = threading.Lock()  # a first request waits for the digest warm() is computing
        self._on_base = True  # the engine holds the weights it loaded (no release swapped in yet)

    def base_digest(self) -> str:
        with self._digest_lock:
            if self._digest is None:
                self._digest = model_digest(self.engine.model_dir)
            return self._digest

    def warm(self) -> None:
        """The base digest (SmolLM2: 273 MB hashed), which a new scenario's creation release names."""
        self.base_digest()

    def creation_files(self) -> Mapping[str, Any]:
        """``base.json``: the base model's name and digest (a reference, not a copy of the weights)."""
        ref = {"model": str(getattr(self.engine, "name", "")), "digest": self.base_digest()}
        return {BASE_REFERENCE: (json.dumps(ref, sort_keys=True, indent=1) + "\n").encode()}

    # -- who trains what ---------------------------------------------------------------------------------------

    def claim(self, scenario: str, lora: bool = False) -> None:
        """Register ``scenario`` as trained here: through its own LoRA adapter (``lora``), else as the one scenario
        whose training moves the engine's full weights. Raises :class:`Conflict` (the scenario does not train)
        when the two kinds would share the engine, or for a second full-weight scenario."""
        with self._lock:
            self._claim(scenario, lora)

    def _claim(self, scenario: str, lora: bool) -> None:
        if lora:
            if self.owner == scenario:
                raise Conflict(f"scenario {scenario!r} trains this engine's full weights; a LoRA adapter of it cannot "
                               f"be served beside them (set trainer.lora consistently)")
            if self.owner is not None:
                raise Conflict(
                    f"scenario {scenario!r} trains a LoRA adapter, but scenario {self.owner!r} trains this engine's "
                    f"full weights, which would move the adapter's base; set trainer.lora=true for {self.owner!r} "
                    f"too, or serve {scenario!r} from another deployment")
            self.adapters.setdefault(scenario, 0)
            return
        if self.adapters and scenario not in self.adapters:
            names = ", ".join(repr(n) for n in sorted(self.adapters))
            raise Conflict(
                f"scenario {scenario!r} trains full weights, but LoRA adapters of scenario(s) {names} sit on this "
                f"engine's base weights, which a full-weight swap would move under them; set trainer.lora=true "
                f"for {scenario!r}, or serve it from another deployment")
        if scenario in self.adapters:
            raise Conflict(f"scenario {scenario!r} trains a LoRA adapter here; a full-weight release of it cannot be "
                           f"served beside the adapters (set trainer.lora=true consistently)")
        if self.owner is None:
            self.owner = scenario
        elif self.owner != scenario:
            raise Conflict(f"this process already trains the weights of scenario {self.owner!r}; one full-weight "
                           f"scenario per process (set trainer.lora=true to train each through its own adapter, "
                           f"or start another deployment for {scenario!r})")

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

    # -- activation --------------------------------------------------------------------------------------------

    def activate(self, scenario, release_id, payload=None, files=None) -> None:
        with self._lock:
            contents = files() if payload is None else None
            ref = base_reference(contents) if contents is not None else None
            if ref is not None and ref["digest"] != self.base_digest():
                raise ConfigError(f"release {release_id} of scenario {scenario!r} names base model "
                                  f"{ref.get('model')!r} ({ref['digest']}), but the engine loaded "
                                  f"{getattr(self.engine, 'name', '?')!r} ({self.base_digest()})")
            version = self._activate(scenario, ref, payload, contents)
            self.release_of[version] = release_id
            log.info("scenario %s now served by %s (release %s)", scenario, version, release_id)

    def _activate(self, scenario: str, ref: dict | None, payload: Any, contents: Mapping[str, Any] | None) -> str:
        """Serve the release (``ref``: a creation release); the version that serves ``scenario`` now."""
        adapter = payload if isinstance(payload, AdapterWeights) else None
        if self.owner == scenario and adapter is None:
            # The full-weight owner: each of its releases moves the engine's weights (an adapter's files merged).
            return self._swap_full(ref, payload, contents)
        if adapter is None and contents is not None and ADAPTER_WEIGHTS in contents:
            adapter = AdapterWeights.from_files(contents)
        if adapter is not None:
            self._claim(scenario, lora=True)
            return self._next_adapter_version(scenario, adapter)
        if ref is None:  # full weights
            self._claim(scenario, lora=False)
            return self._swap_full(ref, payload, contents)
        if scenario in self.adapters:
            # The start of a LoRA scenario: the base, on its own line once an adapter has served it.
            if self._on_line.get(scenario):
                return self._next_adapter_version(scenario, None)
            return str(self.engine.version)
        # A start of a scenario not known to train here: it gets what the engine serves, which must be the base.
        if self.owner is not None and not self._on_base:
            self._claim(scenario, lora=False)  # raises: the owner moved the weights away from this scenario's base
        return str(self.engine.version)

    def _next_adapter_version(self, scenario: str, adapter: AdapterWeights | None) -> str:
        """Load ``adapter`` (None: the base) as ``scenario``'s next version; its sequence moves only once loaded."""
        if not isinstance(self.engine, AdapterSink):
            raise ConfigError(f"scenario {scenario!r} trains a LoRA adapter, but engine "
                              f"{getattr(self.engine, 'name', '?')!r} cannot serve adapters (engine.kind=local, sglang or vllm can)")
        seq = self.adapters.get(scenario, 0) + 1
        version = str(ServedVersion(self.incarnation, seq).adapter_line(adapter_key(scenario)))
        self.ports.run_async(self.engine.load_adapter(scenario, version, adapter))
        self.adapters[scenario] = seq
        self._on_line[scenario] = True
        return version

    def _swap_full(self, ref: dict | None, payload: Any, contents: Mapping[str, Any] | None) -> str:
        if ref is not None and self._on_base:
            # The engine already serves the base: its current version is this release (no swap, no new version).
            return str(self.engine.version)
        state = payload if payload is not None else state_dict_from_files(contents, self.ports.load_base_model)
        version = str(ServedVersion(self.incarnation, self.sequence).next())
        self.ports.run_async(self.engine.swap_weights(version, state))
        self.sequence += 1
        self._on_base = ref is not None  # only once the swap succeeded
        return version

    def serving_version(self, scenario: str) -> str | None:
        if self._on_line.get(scenario):
            return str(ServedVersion(self.incarnation, self.adapters[scenario]).adapter_line(adapter_key(scenario)))
        return str(self.engine.version)
