"""The torch trainer backend: runs an :class:`~reef_core.grow.objective.Objective` on a transformers policy.

:class:`TorchTrainer` keeps one policy (full weights or a LoRA adapter through ``peft``) and one AdamW optimizer for
the lifetime of a scenario's learner. Each :meth:`~TorchTrainer.train` call is exactly one optimizer step over the
batch, split into ``grad_accumulation`` micro-batches (see the scaling rule in :mod:`reef_core.grow.objective`).

What a step returns (:class:`~reef_core.grow.trainer.CandidateUpdate`):

* ``payload``: what the local engine loads as it is. Full weights: a state dict for ``swap_weights(version,
  state_dict)``, every tensor of the model (tied duplicates left out: they follow their source). LoRA: an
  :class:`~reef_core.models.adapter.AdapterWeights` (the adapter's config and its own tensors, never merged) for
  ``load_adapter(name, version, adapter)``, so several scenarios' adapters share the engine's one base.
* ``files``: the checkpoint, serialised on first access (a version kept only in memory never pays for it). Full:
  ``model.safetensors``, ``config.json``, ``generation_config.json`` and the tokenizer files, a directory
  ``from_pretrained`` loads. LoRA: ``adapter/adapter_config.json`` and ``adapter/adapter_model.safetensors``, a
  directory ``PeftModel.from_pretrained`` loads on top of the base model. With ``export_objective_state`` the
  objective's tensors (a critic) are added as ``algorithm/<objective>.safetensors``.
* ``metrics``: ``loss``, ``grad_norm`` (before clipping), ``seconds``, ``reward_mean``, ``policy_lag_{max,mean}``
  (serving sequence minus producing sequence, from the samples' ``<incarnation>:<seq>`` versions), the token-batch
  counters and the objective's own metrics. Non-finite values become ``None`` (JSON).

Candidates are gated: until :meth:`~TorchTrainer.accepted` the step is provisional, and
:meth:`~TorchTrainer.rejected` restores the weights and the objective's state (a critic) to the last accepted
snapshot and restarts the optimizer's moments (copying AdamW state at every step would double its memory).
The policy is kept in ``eval`` mode throughout, so its log-probs match the serving engine's (no dropout noise in
the importance ratio).

Reference model: an objective with ``needs_reference`` gets the frozen base in ``setup(..., reference=)`` (see
:mod:`reef_core.grow.reference`). With LoRA it is the policy with its adapter disabled; with full weights a frozen
copy shared by every trainer of the same base (``reference_key``) in the process. It always comes from
``load_reference_model`` (the scenario's base, never a later checkpoint). A LoRA policy is built on that base too:
the adapter of the serving release is restored over it (:meth:`~TorchTrainer._load_release`), never merged in.

:meth:`~TorchTrainer.run_task` answers the gate's evaluation tasks from a private copy of the local engine holding
the candidate's payload, or the snapshot's weights for the current release (see :mod:`reef_core.grow.eval_engine`;
it costs one more copy of the model, made on the first evaluation).

The base model is loaded on first use (:meth:`~TorchTrainer.load`, called by the first step or by reading
``policy``), not in the constructor: a learner may build its trainer before it knows the scenario's head.

Restart: when the scenario's serving release is not the one this trainer last saw (a restart, a rollback), the
weights are loaded from that release's files (``ctx.current_files()``) and the optimizer state is reset.
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import math
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

from reef_core.config.schema import EngineConfig, TrainerConfig
from reef_core.errors import ConfigError
from reef_core.models.device import resolve_device
from reef_core.grow.eval_engine import EvalEngine, EvalGeneration
from reef_core.grow.objective import Objective, lora_targets
from reef_core.grow.optim import adamw, clipped_step
from reef_core.grow.reference import AdapterBaseReference, ReferenceModel, SharedBaseReference
from reef_core.grow.token_batch import TokenBatch
from reef_core.grow.trainer import CandidateUpdate, TrainContext, Trainer
from reef_core.models.adapter import AdapterWeights
from reef_core.models.release_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MODEL_FILE, base_reference

log = logging.getLogger("reef.grow.torch")

_SNAPSHOT_SERIALS = itertools.count(1)

_PEFT_PREFIX = "base_model.model."


def _safetensors_bytes(tensors: Mapping[str, Tensor]) -> bytes:
    from safetensors.torch import save

    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    return save(cpu, metadata={"format": "pt"})


def _load_safetensors(data: Any) -> dict[str, Tensor]:
    from safetensors.torch import load, load_file

    if isinstance(data, (bytes, bytearray, memoryview)):
        return load(bytes(data))
    return load_file(str(data))


def _read_dir(directory: Path, prefix: str = "") -> dict[str, bytes]:
    return {prefix + str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return value if math.isfinite(float(value)) else None
    return value


class LazyFiles(Mapping):
    """A release's files whose big entries are serialised on first access (then cached).

    ``static`` entries are ready bytes; ``build()`` returns the rest (``lazy_names``) at once."""

    def __init__(self, static: Mapping[str, bytes], lazy_names: list[str], build: Callable[[], dict[str, bytes]]):
        self._static = dict(static)
        self._names = list(self._static) + [n for n in lazy_names if n not in self._static]
        self._lazy = set(lazy_names)
        self._build = build
        self._built: dict[str, bytes] | None = None
        self._lock = threading.Lock()

    def __getitem__(self, name: str) -> bytes:
        if name in self._lazy:
            with self._lock:
                if self._built is None:
                    self._built = self._build()
                    self._build = None  # drop the references to the cloned tensors
            return self._built[name]
        return self._static[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def policy_lag(versions: list[list[str | None]], serving: str | None) -> list[int]:
    """Serving sequence minus producing sequence, per sample (its oldest turn), within the serving incarnation (an
    adapter's own version line; the base counts as its sequence 0, see ``eligibility.on_line``).

    Samples from another incarnation, with unparseable versions or ahead of the serving version are left out."""
    from reef_core.versions import on_line, parse_version

    if not serving:
        return []
    try:
        incarnation, now = parse_version(serving)
    except ValueError:
        return []
    lags = []
    for turns in versions:
        seqs = []
        for v in turns:
            try:
                inc, seq = on_line(parse_version(v), (incarnation, now)) if v else (None, None)
            except ValueError:
                inc, seq = None, None
            if inc == incarnation and seq is not None and seq <= now:
                seqs.append(seq)
        if seqs and len(seqs) == len(turns):
            lags.append(now - min(seqs))
    return lags


@dataclass(frozen=True)
class TorchTrainerOptions:
    """The settings of a :class:`TorchTrainer`; the knobs of the ``trainer`` config section default to that section's
    values (their one source), :meth:`from_config` reads them from a deployment's section.

    Fields:
        lr, weight_decay, betas: AdamW settings (constant learning rate).
        lora, lora_rank, lora_alpha, lora_dropout, lora_target_modules: train a LoRA adapter instead of every
            weight (``peft``; ``"all-linear"`` adapts every linear layer but the output head).
        lora_layers: adapt only the last N transformer layers (``None``: every layer); the backward pass stops at
            the lowest adapted one.
        grad_accumulation: micro-batches per step (capped at the batch size).
        max_grad_norm: clip the global gradient norm (``None``: no clipping; the norm is still reported).
        device: ``trainer.device`` (see :mod:`reef_core.models.device`): where the policy, the objective's models and
            the batches live; ``None`` follows the engine's default device (``from_config`` passes the deployment's
            resolved ``engine.device``).
        export_objective_state: add the objective's tensors (a critic) to every release's files.
        lag_metric_prefix: prefix of the ``policy_lag_*`` metric names (``"sao/"`` gives SAO's names).
        seed: seeds the adapter initialisation (the caller's RNG state is left alone).
        name: recorded in the release provenance.
        eval_model_dir, eval_generation, eval_max_new_tokens: the private evaluation engine of
            :meth:`TorchTrainer.run_task` (the served model's directory, ``evaluation.options.generation``, the reply
            budget by default).
    """

    lr: float = TrainerConfig.lr
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    lora: bool = TrainerConfig.lora
    lora_rank: int = TrainerConfig.lora_rank
    lora_alpha: float = TrainerConfig.lora_alpha
    lora_dropout: float = 0.0
    lora_target_modules: str | list[str] = "all-linear"
    lora_layers: int | None = TrainerConfig.lora_layers
    grad_accumulation: int = TrainerConfig.grad_accumulation
    max_grad_norm: float | None = 1.0
    device: str | None = TrainerConfig.device
    export_objective_state: bool = False
    lag_metric_prefix: str = ""
    seed: int = 0
    name: str = "torch"
    eval_model_dir: str | Path | None = None
    eval_generation: EvalGeneration | None = None
    eval_max_new_tokens: int = 64

    @classmethod
    def from_config(cls, trainer: TrainerConfig, context: Any = None, **overrides) -> "TorchTrainerOptions":
        """The options a deployment's ``trainer`` section gives (``lr``, ``lora``, ``lora_rank``, ``lora_alpha``,
        ``lora_layers``, ``grad_accumulation``, ``device``) with what the learner's ``context`` adds (the engine's
        device when ``trainer.device`` is unset, the seed, the evaluation engine's settings); ``overrides`` win."""
        settings: dict[str, Any] = dict(
            lr=trainer.lr, lora=trainer.lora, lora_rank=trainer.lora_rank, lora_alpha=trainer.lora_alpha,
            lora_layers=trainer.lora_layers, grad_accumulation=trainer.grad_accumulation,
            device=trainer.device if trainer.device is not None else getattr(context, "device", None),
            seed=int(getattr(context, "seed", 0) or 0))
        evaluation = getattr(context, "evaluation", None)
        engine = getattr(context, "engine", None)
        # The gate's replies come from a private copy of the served model (see TorchTrainer.run_task).
        settings.update(eval_model_dir=getattr(engine, "model_dir", None),
                        eval_max_new_tokens=getattr(engine, "max_new_tokens", 64),
                        eval_generation=EvalGeneration.from_options(
                            (getattr(evaluation, "options", None) or {}).get("generation")))
        settings.update(overrides)
        return cls(**settings)

    def check(self) -> None:
        """Refuse settings the backend cannot train with."""
        if not self.lr > 0:
            raise ConfigError(f"trainer lr must be positive, got {self.lr}")
        if isinstance(self.grad_accumulation, bool) or int(self.grad_accumulation) < 1:
            raise ConfigError(f"trainer grad_accumulation must be a positive integer, got {self.grad_accumulation}")
        if self.lora and int(self.lora_rank) < 1:
            raise ConfigError(f"trainer lora_rank must be positive, got {self.lora_rank}")
        layers = self.lora_layers
        if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
            raise ConfigError(f"trainer lora_layers must be a positive integer or null, got {layers!r}")


_OPTION_NAMES = frozenset(f.name for f in fields(TorchTrainerOptions))


class TorchTrainer(Trainer):
    """One scenario's policy and optimizer, stepped by an objective (see the module docstring).

    Args:
        objective: the recipe's loss.
        load_base_model: ``() -> (model, tokenizer)`` (``TrainerSetup.load_base_model``): the model a full-weight
            policy starts from (the scenario's head checkpoint on a restart).
        options: the backend's settings (:class:`TorchTrainerOptions`; default: every default).
        load_reference_model: ``() -> (model, tokenizer)`` of the scenario's base, never a later checkpoint
            (``TrainerSetup.load_reference_model``): the reference model, the base under a LoRA adapter and the
            base a rollback to the creation release restores. Default: ``load_base_model``.
        reference_key: the base's identity in the process-wide reference cache (two trainers with equal keys share
            one frozen copy); default: ``load_reference_model`` itself.
    """

    artifact_kind = "weights"

    @classmethod
    def from_config(cls, objective: Objective, context: Any, trainer: TrainerConfig, *, who: str,
                    **overrides) -> "TorchTrainer":
        """Build from the deployment's ``trainer`` section (``backend``, ``lr``, ``lora``, ``lora_rank``,
        ``lora_alpha``, ``grad_accumulation``, ``device``, ``options``); ``overrides`` win. ``backend: ray`` gives
        this class with its policy update on Ray workers (:mod:`reef_core.grow.ray_backend`). ``who`` names the
        recipe in errors.
        An unset ``trainer.device`` follows the engine's (``context.device``); ``context.load_reference_model`` (the
        scenario's base) is passed on when set."""
        if trainer.backend == "ray":
            # The same trainer (and recipe subclass), its policy update data-parallel on Ray workers.
            from reef_core.extras import require
            from reef_core.grow.ray_backend import RayOptions, with_ray

            require("ray", f"{who} with trainer.backend=ray")
            cls, overrides = with_ray(cls), {"ray": RayOptions.from_config(trainer.options, who=who), **overrides}
        elif trainer.backend != "torch":  # another backend runs the same objective (reef_core.grow.backends)
            from reef_core.grow.backends import build_trainer

            return build_trainer(objective, context, trainer, who=who, **overrides)
        if context is None or getattr(context, "load_base_model", None) is None:
            raise ConfigError(f"{who} needs a local base model to train (engine.kind=local)")
        # Overrides of the options go into them; the rest (a backend's own, e.g. ``ray``) to the constructor.
        options = TorchTrainerOptions.from_config(
            trainer, context, **{k: v for k, v in overrides.items() if k in _OPTION_NAMES})
        extra = {k: v for k, v in overrides.items() if k not in _OPTION_NAMES}
        if getattr(context, "load_reference_model", None) is not None:
            extra.setdefault("load_reference_model", context.load_reference_model)
        return cls(objective, context.load_base_model, options, **extra)

    def __init__(self, objective: Objective, load_base_model: Callable[[], tuple[Any, Any]],
                 options: TorchTrainerOptions | None = None, *,
                 load_reference_model: Callable[[], tuple[Any, Any]] | None = None, reference_key: Any = None):
        if load_base_model is None:
            raise ConfigError("the torch trainer needs a base model loader (TrainerSetup.load_base_model)")
        options = options if options is not None else TorchTrainerOptions()
        options.check()
        self.options = options
        self.objective = objective
        self.lr = float(options.lr)
        self.lora = bool(options.lora)
        self.grad_accumulation = int(options.grad_accumulation)
        self.max_grad_norm = None if options.max_grad_norm is None else float(options.max_grad_norm)
        spec, field = ((options.device, "trainer.device") if options.device is not None
                       else (EngineConfig.device, "engine.device"))
        self.device = torch.device(resolve_device(spec, field=field))
        self.export_objective_state = bool(options.export_objective_state)
        self.lag_metric_prefix = options.lag_metric_prefix
        self.name = options.name
        self.steps = 0
        self._loader = load_base_model
        self._reference_loader = load_reference_model if load_reference_model is not None else load_base_model
        self._reference_key = reference_key if reference_key is not None else self._reference_loader
        self._reference: ReferenceModel | None = None
        self._lora_args = (int(options.lora_rank), float(options.lora_alpha), float(options.lora_dropout),
                           options.lora_target_modules, int(options.seed), options.lora_layers)
        self._opt_args = {"lr": self.lr, "betas": tuple(options.betas), "weight_decay": float(options.weight_decay)}
        self._loaded = False
        self._load_lock = threading.Lock()
        self._expected_release: str | None = None
        self._first_step = True
        self._last_update: CandidateUpdate | None = None
        self._eval_model_dir = options.eval_model_dir
        self._eval_settings = (options.eval_generation or EvalGeneration(), int(options.eval_max_new_tokens))
        self._eval_engine: EvalEngine | None = None
        #: Candidates made by this process (a retried step may reuse a candidate id, never this count).
        self._candidates_made = 0

    # -- setup -------------------------------------------------------------------------------------------------

    def load(self) -> None:
        """Load the base model, build the objective's auxiliary models and the optimizer (once).

        Deferred to first use (a step, or reading :attr:`policy`), so a learner may build its trainer before it
        knows which checkpoint the scenario starts from."""
        if self._loaded:
            return
        with self._load_lock:
            if self._loaded:
                return
            # A LoRA policy trains over the plain base: the serving release's adapter is restored over it.
            model, tokenizer = (self._reference_loader if self.lora else self._loader)()
            model.to(self.device)
            model.eval()  # see the module docstring: no dropout in the importance ratio
            self._tokenizer = tokenizer
            pad = getattr(tokenizer, "pad_token_id", None)
            if pad is None:
                pad = getattr(tokenizer, "eos_token_id", None)
            self.pad_token_id = int(pad) if pad is not None else 0
            self._static_files = self._static_model_files(model, tokenizer) if not self.lora else {}
            # Auxiliary models copy the plain base model, before an adapter is injected into it.
            self._reference = self._make_reference(model) if self.objective.needs_reference else None
            if self._reference is not None:
                self.objective.setup(model, tokenizer, self.device, micro_batches=self.grad_accumulation,
                                     reference=self._reference)
            else:
                self.objective.setup(model, tokenizer, self.device, micro_batches=self.grad_accumulation)
            if self.lora:
                model = self._attach_lora(model, *self._lora_args)
                if isinstance(self._reference, AdapterBaseReference):
                    self._reference.bind(model)  # from now on: the PeftModel with its adapter disabled
            else:
                model.requires_grad_(True)
            self._policy: nn.Module = model
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            self._param_names = [n for n, _ in named]
            self._params = [p for _, p in named]
            self._optimizer = adamw(self._params, **self._opt_args)
            self._export_keys = self._dedup_keys(model) if not self.lora else []
            self._snapshot = self._take_snapshot()
            self._loaded = True

    def _make_reference(self, model: nn.Module) -> ReferenceModel:
        """The objective's frozen base: the (soon adapted) policy itself with LoRA, else the shared frozen copy."""
        accepts = inspect.signature(self.objective.setup).parameters
        if "reference" not in accepts and not any(p.kind is p.VAR_KEYWORD for p in accepts.values()):
            raise ConfigError(f"objective {self.objective.name!r} sets needs_reference but its setup() does not "
                              "accept reference=")
        if self.lora:
            return AdapterBaseReference(model)
        return SharedBaseReference(self._reference_key, self._reference_loader, self.device)

    @property
    def policy(self) -> nn.Module:
        """The trained model (a ``PeftModel`` in LoRA mode)."""
        self.load()
        return self._policy

    @property
    def reference(self) -> ReferenceModel | None:
        """The frozen base given to the objective (None unless it sets ``needs_reference``)."""
        self.load()
        return self._reference

    @property
    def tokenizer(self) -> Any:
        self.load()
        return self._tokenizer

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        self.load()
        return self._optimizer

    @staticmethod
    def _static_model_files(model: nn.Module, tokenizer: Any) -> dict[str, bytes]:
        """config.json, generation_config.json and tokenizer files: they never change between steps."""
        with tempfile.TemporaryDirectory(prefix="reef-export-") as tmp:
            root = Path(tmp)
            model.config.save_pretrained(root)
            gen = getattr(model, "generation_config", None)
            if gen is not None:
                gen.save_pretrained(root)
            if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
                tokenizer.save_pretrained(root)
            return _read_dir(root)

    def _attach_lora(self, model, rank, alpha, dropout, targets, seed, layers=None):
        from peft import LoraConfig, get_peft_model

        targets = list(targets) if not isinstance(targets, str) else targets
        config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, bias="none", task_type="CAUSAL_LM",
                            **lora_targets(model, targets, layers))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            peft_model = get_peft_model(model, config)
        peft_model.eval()
        with tempfile.TemporaryDirectory(prefix="reef-adapter-") as tmp:
            peft_model.peft_config["default"].save_pretrained(tmp)
            self._adapter_config = (Path(tmp) / "adapter_config.json").read_bytes()
        return peft_model

    @staticmethod
    def _dedup_keys(model: nn.Module) -> list[str]:
        """State-dict keys without tied duplicates (a tensor sharing storage with an earlier key)."""
        seen: set[tuple[int, int]] = set()
        keys = []
        for key, value in model.state_dict().items():
            ident = (value.untyped_storage().data_ptr(), value.storage_offset())
            if value.numel() and ident in seen:
                continue
            seen.add(ident)
            keys.append(key)
        return keys

    # -- snapshots (gate) --------------------------------------------------------------------------------------

    def _take_snapshot(self, reuse: Mapping[str, Tensor] | None = None) -> dict:
        """The rollback point: trainable weights, the objective's state and the step counter.

        ``reuse`` (an accepted full-weight payload: clones of these very weights) is kept instead of copying
        the weights again. Optimizer moments are not copied (they would double the optimizer's memory): a
        rejection restarts them."""
        params = []
        for name, p in zip(self._param_names, self._params):
            kept = reuse.get(name) if reuse is not None else None
            if kept is not None and kept.shape == p.shape and kept.dtype == p.dtype and kept.device == p.device:
                params.append(kept)
            else:
                params.append(p.detach().clone())
        # ``serial`` names these weights for the evaluation engine (reloaded only when they change).
        return {"params": params, "objective": self.objective.snapshot(), "steps": self.steps,
                "serial": next(_SNAPSHOT_SERIALS)}

    def _restore_snapshot(self, snap: dict) -> None:
        with torch.no_grad():
            for p, saved in zip(self._params, snap["params"]):
                p.copy_(saved)
        self._optimizer = adamw(self._params, **self._opt_args)
        self.objective.restore(snap["objective"])
        self.steps = snap["steps"]

    def accepted(self, update: CandidateUpdate, release_id: str | None) -> None:
        """Commit the in-memory policy (and the objective's state) as the new rollback point."""
        self.load()
        latest = update is not None and update is self._last_update
        reuse = update.payload if latest and not self.lora and isinstance(update.payload, Mapping) else None
        self._snapshot = self._take_snapshot(reuse)
        if release_id is not None:
            self._expected_release = release_id

    def rejected(self, update: CandidateUpdate) -> None:
        """Restore the weights and the objective's state to the last accepted snapshot.

        The optimizer's moments restart (AdamW state is not snapshotted: it would double its memory)."""
        if not self._loaded:
            return  # nothing trained yet
        self._restore_snapshot(self._snapshot)

    # -- evaluation (gate) -------------------------------------------------------------------------------------

    def run_task(self, subject: Any, task: dict) -> str:
        """The reply to ``task["messages"]`` with ``subject``'s weights, from the private evaluation engine.

        A ``Candidate`` is its payload (this trainer's step); a ``Current`` is the last accepted weights (the
        snapshot: what serves now). Serving is never touched (see :mod:`reef_core.grow.eval_engine`)."""
        from reef_core.commit.gate import Candidate, Current

        self.load()
        if isinstance(subject, Candidate):
            key = ("candidate", subject.candidate_id, self._candidates_made)
        elif isinstance(subject, Current):
            key = ("current", self._snapshot["serial"])
        else:
            raise TypeError(f"run_task takes a Candidate or a Current, not {type(subject).__name__}")
        engine = self._evaluation_engine()
        return engine.generate(key, lambda target: self._load_eval_weights(target, subject), task["messages"])

    def _evaluation_engine(self) -> EvalEngine:
        if self._eval_engine is None:
            if self._eval_model_dir is None:
                raise ConfigError("evaluating weight candidates on tasks needs the local engine (engine.kind=local): "
                                  "the trainer has no model directory to start its evaluation engine from")
            generation, max_new = self._eval_settings
            self._eval_engine = EvalEngine(self._eval_model_dir, device=str(self.device), generation=generation,
                                           max_new_tokens=max_new)
        return self._eval_engine

    def _load_eval_weights(self, engine: Any, subject: Any) -> None:
        """Put ``subject``'s weights into the evaluation engine: the one place that knows the payload's form."""
        from reef_core.commit.gate import Candidate

        if isinstance(subject, Candidate):
            if not isinstance(subject.payload, (Mapping, AdapterWeights)):
                raise ValueError(f"candidate {subject.candidate_id} carries no weights payload")
            state = subject.payload
        elif not self.lora:
            # Full weights: the snapshot's tensors under their parameter names (tied copies follow their source).
            state = dict(zip(self._param_names, self._snapshot["params"]))
        else:
            # LoRA: the snapshot's adapter (its tensors are small to copy in and out of the live policy).
            with torch.no_grad():
                live = [p.detach().clone() for p in self._params]
                for p, saved in zip(self._params, self._snapshot["params"]):
                    p.copy_(saved)
                try:
                    state = self._payload()
                finally:
                    for p, kept in zip(self._params, live):
                        p.copy_(kept)
        self._eval_engine.swap(engine, state)

    # -- restart / rollback sync -------------------------------------------------------------------------------

    def _sync(self, ctx: TrainContext) -> None:
        self.load()
        if self._first_step:
            self._first_step = False
            state = ctx.algorithm_state if isinstance(ctx.algorithm_state, dict) else None
            if state:
                self.steps = int(state.get("steps", 0) or 0)
                self.objective.load_json_state(state.get("objective_state"))
        if ctx.serving_release_id is not None and ctx.serving_release_id != self._expected_release:
            self._load_release(ctx.serving_release_id, ctx.current_files())
        self._expected_release = ctx.serving_release_id

    def _load_release(self, release_id: str, files: Mapping[str, Any]) -> None:
        """Load the weights of a release this trainer did not produce in this process (restart, rollback)."""
        loaded = False
        if base_reference(files) is not None:
            # A creation release: back to the base. Freshly loaded, the policy already is it (it loads the head).
            if self._expected_release is not None:
                self._reset_to_base()
                loaded = True
        elif not self.lora and MODEL_FILE in files:
            state = _load_safetensors(files[MODEL_FILE])
            missing = [k for k in self._export_keys if k not in state]
            if missing:
                raise ConfigError(f"release {release_id} lacks weights {missing[:3]}; cannot resume from it")
            self._policy.load_state_dict(state, strict=False)
            loaded = True
        elif self.lora and ADAPTER_WEIGHTS in files:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self._policy, _load_safetensors(files[ADAPTER_WEIGHTS]))
            loaded = True
        objective_file = f"algorithm/{self.objective.name}.safetensors"
        if objective_file in files:
            self.objective.load_state_dict(_load_safetensors(files[objective_file]))
        if loaded:
            self._optimizer = adamw(self._params, **self._opt_args)  # another lineage: fresh moments
            log.info("trainer resumed from release %s", release_id)
        else:
            log.info("release %s holds no %s weights; training continues from the weights in memory", release_id,
                     "adapter" if self.lora else "model")
        self._snapshot = self._take_snapshot()

    def _reset_to_base(self) -> None:
        """The base weights again: zeroed LoRA ``B`` matrices (the adapter adds nothing), or the base state dict."""
        with torch.no_grad():
            if self.lora:
                for name, param in self._policy.named_parameters():
                    if "lora_B" in name:
                        param.zero_()
            else:
                base = self._reference_loader()[0].state_dict()
                self._policy.load_state_dict({k: base[k] for k in self._export_keys}, strict=False)

    # -- export ------------------------------------------------------------------------------------------------

    def _payload(self) -> dict[str, Tensor] | AdapterWeights:
        """What the local engine loads (see the module docstring): the full state dict, or the LoRA adapter."""
        with torch.no_grad():
            if not self.lora:
                own = self._policy.state_dict()
                return {k: own[k].detach().clone() for k in self._export_keys}
            from peft import get_peft_model_state_dict

            tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(self._policy).items()}
            return AdapterWeights(json.loads(self._adapter_config), tensors)

    def _files(self, payload: dict[str, Tensor] | AdapterWeights) -> LazyFiles:
        extra: dict[str, Tensor] | None = None
        names: list[str] = []
        if self.export_objective_state:
            extra = {k: v.detach().clone() for k, v in self.objective.state_dict().items()}
            names.append(f"algorithm/{self.objective.name}.safetensors")
        if isinstance(payload, AdapterWeights):
            static = {ADAPTER_CONFIG: self._adapter_config}
            names.insert(0, ADAPTER_WEIGHTS)
            main = (ADAPTER_WEIGHTS, payload.tensors)
        else:
            static = self._static_files
            names.insert(0, MODEL_FILE)
            main = (MODEL_FILE, payload)

        def build() -> dict[str, bytes]:
            out = {main[0]: _safetensors_bytes(main[1])}
            if extra is not None:
                out[f"algorithm/{self.objective.name}.safetensors"] = _safetensors_bytes(extra)
            return out

        return LazyFiles(static, names, build)

    # -- the step ----------------------------------------------------------------------------------------------

    def _apply_gradients(self, prepared) -> tuple[float, dict[str, float], float]:
        """The policy update of one step: backward over the micro-batches, clip, and step the optimizer unless the
        gradient norm is non-finite. Returns the summed loss, the summed metric ``sums`` and the norm before
        clipping. (Another backend, e.g. :mod:`reef_core.grow.ray_backend`, runs this part elsewhere.)"""
        self._optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        total = 0.0
        for micro in prepared.batch.split(self.grad_accumulation):
            loss, parts = self.objective.loss(self._policy, micro, prepared)
            loss.backward()
            total += float(loss.detach())
            for key, value in parts.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        grad_norm = clipped_step(self._optimizer, self._params, self.max_grad_norm)  # no step if non-finite
        self._optimizer.zero_grad(set_to_none=True)
        return total, sums, grad_norm

    def token_batch(self, samples: list) -> TokenBatch:
        """The :class:`TokenBatch` of ``samples`` on the trainer's device."""
        self.load()
        return TokenBatch.from_samples(samples, pad_token_id=self.pad_token_id).to(self.device)

    def train(self, batch, ctx: TrainContext) -> CandidateUpdate | None:
        """One optimizer step over ``batch`` (a processor :class:`~reef_core.observe.processor.Batch`)."""
        started = time.monotonic()
        self._sync(ctx)
        tb = self.token_batch(list(batch.samples))
        update = self.step(tb)
        if update is None:
            return None
        lags = policy_lag(tb.versions, ctx.serving_version)
        if lags:
            update.metrics[f"{self.lag_metric_prefix}policy_lag_max"] = float(max(lags))
            update.metrics[f"{self.lag_metric_prefix}policy_lag_mean"] = float(sum(lags) / len(lags))
        update.metrics["seconds"] = time.monotonic() - started
        update.source = {"trainer": self.name, "objective": self.objective.name, "step": ctx.step,
                         "batch_id": getattr(batch, "batch_id", None), "samples": tb.size,
                         "mode": "lora" if self.lora else "full", "serving_version": ctx.serving_version}
        return update

    def step(self, tb: TokenBatch) -> CandidateUpdate | None:
        """The step itself on a ready :class:`TokenBatch` (no context: tests and offline runs call this)."""
        started = time.monotonic()
        self.load()
        prepared = self.objective.prepare(self._policy, tb)
        metrics: dict[str, Any] = {
            "reward_mean": float(tb.rewards.mean()),
            "reward_std": float(tb.rewards.std(unbiased=False)),
            **{f"batch/{k}": v for k, v in tb.stats.items()},
            **prepared.metrics,
        }
        if not prepared.update_policy:
            # Auxiliary models only (e.g. critic warm-up): nothing to gate, keep it.
            self._snapshot["objective"] = self.objective.snapshot()
            log.info("step trained the objective's auxiliary models only; no candidate")
            return None
        total, sums, grad_norm = self._apply_gradients(prepared)
        if not math.isfinite(grad_norm):
            # The policy was not stepped; undo what the objective's preparation changed (a critic step).
            self.objective.restore(self._snapshot["objective"])
            log.warning("non-finite gradient norm (%s); step skipped", grad_norm)
            return None
        self.steps += 1
        metrics.update(self.objective.summarize(prepared, sums))
        metrics.update({"loss": total, "grad_norm": grad_norm, "lr": self.lr,
                        "step_seconds": time.monotonic() - started})
        payload = self._payload()
        self._candidates_made += 1
        self._last_update = CandidateUpdate(
            files=self._files(payload),
            payload=payload,
            metrics={k: _finite_or_none(v) for k, v in metrics.items()},
            algorithm_state={"objective": self.objective.name, "steps": self.steps,
                             "objective_state": self.objective.json_state()},
        )
        return self._last_update
