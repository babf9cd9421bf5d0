"""slime's command line as Reef builds it: loss hooks, the flags a deployment may pass, the flags Reef owns.

Each objective declares its slime loss (``Objective.slime_loss``: a ``reef_slime_hooks`` function or a slime built-in
loss type); this module turns it into flags and knows no objective by name.

Pure Python (no torch, nothing of slime). The flags a deployment may pass and their check at config load live with the
config section they check (:mod:`reef_core.config.slime`); this module builds and checks each job's command line.

Flag names are checked against slime's real argument list (:mod:`reef_core.config.slime_args`, read from slime's source
at the commit it names): slime itself ignores a flag it does not know, so Reef refuses unknown and removed flags at config
load and checks every job's command line before launching it. A job only
trains: Reef hands it the batch as slime's rollout dump (``--load-debug-rollout-data`` with
``--debug-train-only``, so slime starts no SGLang engine of its own) and takes the HF checkpoint back
(``--save-hf``). Reef keeps serving with its own engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from ...config import slime_args
from ...config.slime import ALLOWED, REEF_OWNED  # noqa: F401 (the pass-through and Reef-owned flags, named here too)
from ...errors import ConfigError

#: Where an objective's custom loss lives: ``Objective.slime_loss`` names a function of ``reef_slime_hooks``, the
#: torch-only module shipped in reef-core's wheel (see the README), which slime loads with
#: ``--custom-loss-function-path`` (``module.function``, slime's ``load_function``), or one of slime's built-in losses.
HOOKS = "reef_slime_hooks"
#: slime's built-in loss types an objective may name as its ``slime_loss`` (``--loss-type`` itself).
BUILTIN_LOSSES = ("policy_loss", "sft_loss")

#: What a custom-loss job adds: slime's advantage step runs Reef's loader (the recipe's advantages from the rollout
#: file) instead of an estimator, the old policy is the engine's (no extra forward), and the loss is summed per token
#: (the hooks scale it to the objective's own normaliser).
CUSTOM_LOSS_ARGS = ("--custom-advantage-function-path", f"{HOOKS}.reef_advantages", "--use-rollout-logprobs",
                    "--calculate-per-token-loss")

#: Pass-through flags a custom-loss family refuses: the objective fixes its clip band, KL and normalisation.
CUSTOM_LOSS_REFUSED = frozenset({
    "--eps-clip", "--eps-clip-high", "--eps-clip-c", "--kl-coef", "--kl-loss-coef", "--kl-loss-type", "--use-kl-loss",
    "--entropy-coef", "--use-tis", "--calculate-per-token-loss", "--ref-load",
})

def slime_loss_of(objective: Any) -> str:
    """The slime loss an objective declares (``Objective.slime_loss``); an objective without one is refused."""
    loss = getattr(objective, "slime_loss", None)
    if not loss:
        raise ConfigError(f"trainer.backend=slime has no loss family for objective {objective.name!r} (its objective "
                          f"declares no slime_loss: a {HOOKS} function or one of slime's built-in losses "
                          f"{', '.join(BUILTIN_LOSSES)})")
    return str(loss)


def loss_flags(slime_loss: str) -> dict[str, str]:
    """slime's loss-hook flags for a declared slime loss: a built-in loss type, or ``custom_loss`` and the hook."""
    if slime_loss in BUILTIN_LOSSES:
        return {"--loss-type": slime_loss}
    return {"--loss-type": "custom_loss", "--custom-loss-function-path": f"{HOOKS}.{slime_loss}"}


def family_flags(objective: Any) -> dict[str, str]:
    """slime's loss-hook flags for a Reef objective; an objective without a slime loss is refused."""
    return loss_flags(slime_loss_of(objective))


def is_custom(slime_loss: str) -> bool:
    return loss_flags(slime_loss)["--loss-type"] == "custom_loss"


def check_job_flags(objective: Any, flags: Mapping[str, Any], batch_size: int | None) -> None:
    """What can only be checked knowing the recipe: flags its loss family fixes, and the batch size (Reef trains
    one optimizer step per batch, so slime's ``--global-batch-size`` must be the recipe's batch size)."""
    if is_custom(slime_loss_of(objective)):
        fixed = sorted(CUSTOM_LOSS_REFUSED.intersection(str(k) for k in flags))
        if fixed:
            raise ConfigError(f"trainer.slime.flags: {', '.join(fixed)} cannot be set for the loss family "
                              f"{objective.name!r}: its hook takes the clip band, KL and normalisation from the "
                              "recipe's objective")
    gbs = flags.get("--global-batch-size")
    if gbs is not None and batch_size is not None:
        try:
            gbs_value = int(gbs)
        except (TypeError, ValueError):
            raise ConfigError(f"trainer.slime.flags: --global-batch-size must be an integer, got {gbs!r}") from None
        if gbs_value != int(batch_size):
            raise ConfigError(f"trainer.slime.flags: --global-batch-size {gbs_value} differs from the recipe's batch "
                              f"size {batch_size} (recipe.processor_options.batch_size); Reef trains one optimizer "
                              "step per batch, so they must be equal")


def check_argv(argv: list[str]) -> None:
    """Refuse a job command line slime would misread: a flag slime does not know or no longer has (slime drops both
    silently), a flag given twice, or a missing flag a train-only job needs (:data:`reef_core.config.slime_args.REQUIRED`)."""
    seen: set[str] = set()
    commit = slime_args.SLIME_COMMIT[:8]
    for token in argv:
        if not token.startswith("--"):
            continue
        if token in slime_args.REMOVED:
            raise ConfigError(f"slime job arguments: {token} was removed from slime ({slime_args.REMOVED[token]})")
        if token not in slime_args.KNOWN:
            raise ConfigError(f"slime job arguments: {token} is not a flag of slime {commit}")
        if token in seen:
            raise ConfigError(f"slime job arguments: {token} is given twice")
        seen.add(token)
    for alternatives, why in slime_args.REQUIRED.items():
        if not seen.intersection(alternatives):
            raise ConfigError(f"slime job arguments: {' or '.join(alternatives)} missing ({why})")


def check_hf_model_type(model_dir: Path) -> None:
    """Refuse a base model slime cannot set up from its HF directory (``--load``): slime reads an HF directory
    only for the model types of its ``hf_to_megatron`` loaders."""
    config = Path(model_dir) / "config.json"
    if not config.exists():
        return
    model_type = json.loads(config.read_text()).get("model_type")
    if model_type not in slime_args.HF_MODEL_TYPES:
        raise ConfigError(f"trainer.backend=slime: the base model's model_type {model_type!r} ({model_dir}) is not one "
                          f"slime {slime_args.SLIME_COMMIT[:8]} reads as --load from an HF directory "
                          f"({', '.join(sorted(slime_args.HF_MODEL_TYPES))})")


def job_argv(slime_loss: str, flags: Mapping[str, Any], *, lr: float, rollout: str, hf_in: str,
             hf_out: str, save: str, samples: int) -> list[str]:
    """The slime ``train.py`` arguments of one job: Reef's own flags, the hooks of the objective's declared
    ``slime_loss`` (:func:`slime_loss_of`), then the pass-through.

    The model is set up from ``--load`` = the input HF checkpoint (slime loads an HF directory itself, so no
    ``--ref-load`` is needed), and ``--save-interval 1`` makes the job's one rollout save: slime writes ``--save-hf``
    only from its save step, which also writes a Megatron checkpoint to ``--save`` (inside the job, without optimizer
    or RNG state, removed with the job's inputs)."""
    argv = ["--debug-train-only", "--load-debug-rollout-data", rollout, "--hf-checkpoint", hf_in, "--load", hf_in,
            "--save", save, "--save-interval", "1", "--no-save-optim", "--no-save-rng", "--save-hf", hf_out,
            "--num-rollout", "1", "--rollout-batch-size", str(samples), "--n-samples-per-prompt", "1",
            "--lr", repr(float(lr))]
    for key, value in loss_flags(slime_loss).items():
        argv += [key, value]
    if is_custom(slime_loss):
        argv += list(CUSTOM_LOSS_ARGS)
    for key, value in flags.items():
        if value is True or value is None:
            argv.append(str(key))
        elif value is not False:
            argv += [str(key), str(value)]
    check_argv(argv)
    return argv
