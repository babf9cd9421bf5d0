"""The objective's share of a custom-loss slime step, run in Reef's learner: models, advantages, state.

A custom-loss family's hook (``reef_slime_hooks``) only computes the per-token loss; what comes before it stays
with Reef, as with the torch backend: the objective's ``prepare`` (SAO's critic steps and GAE, GRPO's group
advantages, TTT's KL to the frozen base) runs here on the batch, and its per-token advantages go into the job's
rollout file. The models ``prepare`` needs (a critic copied from the base, the frozen base as reference) are built
by a :class:`~reef_core.grow.torch_backend.TorchTrainer` that never steps; an objective with neither loads nothing.

The objective's state follows the releases: its tensors (a critic) are written with the job and become the
candidate's ``algorithm/<objective>.safetensors``, its JSON state the candidate's ``algorithm_state``; a restart
reads both back from the serving release and the commit log, a rejected candidate restores the last accepted
snapshot.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from ..objective import Objective, Prepared
from ..token_batch import TokenBatch
from ..trainer import TrainContext


def state_file(objective: Objective) -> str:
    return f"algorithm/{objective.name}.safetensors"


def needs_models(objective: Objective) -> bool:
    """True when ``prepare`` needs models built from the base (an overridden ``setup``, or a reference)."""
    return type(objective).setup is not Objective.setup or bool(objective.needs_reference)


def loss_header(objective: Objective, batch: TokenBatch) -> dict[str, Any]:
    """The rollout file's ``reef`` header: family, constants, and ``loss_scale = N / D`` (see ``reef_slime_hooks``):
    ``N`` slime's per-token normaliser (each sample's trained tokens, at least 1), ``D`` the objective's own
    (``loss_norm`` of its :meth:`~reef_core.grow.objective.Objective.slime_header`, with its constants)."""
    per_sample = (batch.action_mask > 0).sum(dim=1).clamp(min=1)
    step_tokens = float(per_sample.sum())
    constants = objective.slime_header(batch)
    own = float(constants.pop("loss_norm"))
    return {"family": objective.name, "loss_scale": step_tokens / own, **constants}


def token_advantages(objective: Objective, prepared: Prepared) -> Tensor:
    """``[B, L]`` per-token advantages the family's hook trains on (the objective's ``slime_advantages``)."""
    return objective.slime_advantages(prepared)


class LearnerSide:
    """One scenario's objective outside the policy update (see the module docstring)."""

    def __init__(self, objective: Objective, load_base_model: Callable[[], tuple[Any, Any]],
                 load_reference_model: Callable[[], tuple[Any, Any]] | None = None, device: str | None = None):
        self.objective = objective
        self._load_base = load_base_model
        self._load_reference = load_reference_model
        self._device = device
        self._models: Any = None
        self._ready = False
        self._expected_release: str | None = None
        self._snapshot: Any = None

    def _setup(self) -> None:
        if needs_models(self.objective):
            from ..torch_backend import TorchTrainer, TorchTrainerOptions

            self._models = TorchTrainer(self.objective, self._load_base,
                                        TorchTrainerOptions(device=self._device, name="slime-learner"),
                                        load_reference_model=self._load_reference)
            self._models.load()  # builds the critic / passes the frozen base to setup()
        else:
            self.objective.setup(None, None, torch.device("cpu"))
        self._ready = True

    def sync(self, ctx: TrainContext) -> None:
        """Set up once; follow the commit log's JSON state and the serving release's tensors after a restart or a
        head this process did not produce."""
        first = not self._ready
        if first:
            self._setup()
            state = ctx.algorithm_state if isinstance(ctx.algorithm_state, dict) else None
            if state:
                self.objective.load_json_state(state.get("objective_state"))
        if first or ctx.serving_release_id != self._expected_release:
            files = ctx.current_files() if ctx.serving_release_id else {}
            if state_file(self.objective) in files:
                self.load_tensors(bytes(files[state_file(self.objective)]))
            self._snapshot = self.objective.snapshot()
        self._expected_release = ctx.serving_release_id

    def prepare(self, batch: TokenBatch) -> Prepared:
        policy = self._models.policy if self._models is not None else None
        device = self._models.device if self._models is not None else torch.device("cpu")
        return self.objective.prepare(policy, batch.to(device))

    # -- state -------------------------------------------------------------------------------------------------

    def tensors(self) -> bytes | None:
        """The objective's tensors as safetensors bytes (None: it has none)."""
        state = self.objective.state_dict()
        if not state:
            return None
        from safetensors.torch import save

        return save({k: v.detach().cpu().contiguous() for k, v in state.items()})

    def load_tensors(self, data: bytes) -> None:
        from safetensors.torch import load

        self.objective.load_state_dict(load(data))

    def accepted(self, release_id: str | None) -> None:
        self._snapshot = self.objective.snapshot()
        if release_id is not None:
            self._expected_release = release_id

    def kept(self) -> None:
        """A step that trained only the objective's own models (no candidate): its state is the new rollback point."""
        self._snapshot = self.objective.snapshot()

    def rejected(self) -> None:
        if self._snapshot is not None:
            self.objective.restore(self._snapshot)

