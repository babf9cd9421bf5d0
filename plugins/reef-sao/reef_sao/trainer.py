"""The ``sao`` trainer component: validated recipe options → objective → :class:`TorchTrainer`.

Registered through ``reef_register_trainers`` and built per scenario by
``make_sao_trainer(scenario=..., recipe=<RecipeConfig>, trainer=<TrainerConfig>, context=<TrainerSetup>)``.
``recipe.options`` carries SAO's knobs (snake_case or kebab-case keys, see :class:`reef_sao.options.SAOOptions`)
next to the
processor's own (``batch_size``, ``max_staleness``...), which the trainer only checks for consistency. The
``trainer`` section gives the backend settings (``backend``: ``torch`` or ``ray``; ``lr``, ``critic_lr``, ``lora``,
``lora_rank``, ``lora_alpha``, ``grad_accumulation``, ``device``).

Validation happens here, at construction (§3.3 of the recipe reference): ε_l ∈ [0, 1), ε_h explicit, a critic for
SAO, ``critic_steps_per_actor`` ≥ 1, and the batch size equal to the trainer's global batch (one optimizer step per
batch, split into equal micro-batches: ``batch_size`` must be a multiple of ``grad_accumulation``; for the GRPO
control also a multiple of ``group_size``).
"""

from __future__ import annotations

from reef_core.api import ConfigError, RecipeConfig, TorchTrainer, TrainerConfig, TrainerSetup

from reef_sao.objectives import objective_for
from reef_sao.options import ADVANTAGES, PROCESSOR_OPTIONS, SAOOptions

__all__ = ["ADVANTAGES", "PROCESSOR_OPTIONS", "SAOOptions", "make_sao_trainer"]


def make_sao_trainer(*, scenario: str, recipe: RecipeConfig, trainer: TrainerConfig, context: TrainerSetup,
                     **_extra) -> TorchTrainer:
    """Build the SAO (or, with ``advantage: grpo``, the sao-grpo-dis control) trainer for one scenario."""
    opts = SAOOptions.from_options(recipe.options, recipe.processor_options)
    grad_accumulation = trainer.grad_accumulation
    if grad_accumulation < 1 or opts.batch_size % grad_accumulation:
        raise ConfigError(f"sao: batch_size {opts.batch_size} must be a multiple of trainer.grad_accumulation "
                          f"{grad_accumulation} (equal micro-batches; one optimizer step per batch)")
    critic_lr = opts.critic_lr if opts.critic_lr is not None else trainer.critic_lr
    objective = objective_for(opts, critic_lr=float(critic_lr), critic_lora=(trainer.lora_rank, trainer.lora_alpha,
                                                                          trainer.lora_layers))
    return TorchTrainer.from_config(
        objective, context, trainer, who="sao",
        max_grad_norm=opts.max_grad_norm,
        weight_decay=opts.weight_decay,
        export_objective_state=opts.save_critic and opts.advantage == "gae",
        lag_metric_prefix="sao/",
        name="sao" if opts.advantage == "gae" else "sao-grpo-dis",
    )
