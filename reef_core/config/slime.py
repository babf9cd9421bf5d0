"""``trainer.slime``: the slime flags a deployment may pass through, and their check when the config loads.

slime ignores a flag it does not know, so a flag Reef owns, one it does not know (:mod:`.slime_args`, slime's real
argument list) or one slime removed is refused at config load, naming it. Each job's command line is built and checked
again by :mod:`reef_core.grow.slime.flags`.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import ConfigError
from . import slime_args

#: Flags Reef sets for every job (refused in ``trainer.slime.flags``: a second value would contradict Reef's).
REEF_OWNED = frozenset({
    "--loss-type", "--custom-loss-function-path", "--custom-advantage-function-path", "--advantage-estimator",
    "--load-debug-rollout-data", "--debug-train-only", "--debug-rollout-only", "--hf-checkpoint", "--save-hf",
    "--load", "--save", "--save-interval", "--no-save-optim", "--no-save-rng", "--num-rollout", "--start-rollout-id",
    "--rollout-batch-size", "--n-samples-per-prompt", "--lr", "--use-rollout-logprobs",
    "--disable-compute-advantages-and-returns",
})

#: Flags a deployment may pass through: parallelism, batch shape, optimizer and loss knobs of a train-only job.
ALLOWED = frozenset({
    "--actor-num-nodes", "--actor-num-gpus-per-node", "--colocate",
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--expert-model-parallel-size", "--sequence-parallel", "--use-dynamic-batch-size", "--max-tokens-per-gpu",
    "--global-batch-size", "--micro-batch-size", "--num-steps-per-rollout",
    "--min-lr", "--lr-decay-style", "--weight-decay", "--adam-beta1", "--adam-beta2", "--clip-grad", "--seed",
    "--optimizer", "--optimizer-cpu-offload", "--bf16", "--fp16",
    "--eps-clip", "--eps-clip-high", "--eps-clip-c", "--kl-coef", "--kl-loss-coef", "--kl-loss-type",
    "--use-kl-loss", "--entropy-coef", "--calculate-per-token-loss", "--use-tis",
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--attention-backend",
    "--ref-load",
})

def validate_flags(flags: Mapping[str, Any]) -> None:
    """Refuse a flag Reef owns or does not know, naming it."""
    for name in flags:
        key = str(name)
        if not key.startswith("--"):
            raise ConfigError(f"trainer.slime.flags: {key!r} is not a flag (slime flags start with '--')")
        if key in slime_args.REMOVED:
            raise ConfigError(f"trainer.slime.flags: {key} was removed from slime ({slime_args.REMOVED[key]}); slime "
                              "would ignore it silently, remove it")
        if key in REEF_OWNED:
            raise ConfigError(f"trainer.slime.flags: {key} is set by Reef for every job (the loss family, the "
                              "batch, the checkpoints, trainer.lr); remove it")
        if key not in ALLOWED:
            raise ConfigError(f"trainer.slime.flags: unknown flag {key} (known: {', '.join(sorted(ALLOWED))})")
        value = flags[name]
        if not (value is None or isinstance(value, (bool, int, float, str))):
            raise ConfigError(f"trainer.slime.flags: {key} needs a scalar value, got {type(value).__name__}")


def validate_settings(settings: Any) -> None:
    """Check the ``trainer.slime`` section (its keys are typed by the schema; this checks the values)."""
    validate_flags(settings.flags or {})
    if not isinstance(settings.timeout_s, (int, float)) or not settings.timeout_s > 0:
        raise ConfigError(f"trainer.slime.timeout_s must be positive, got {settings.timeout_s!r}")
    if any(not isinstance(a, str) or not a for a in settings.launch):
        raise ConfigError("trainer.slime.launch must be a list of non-empty strings (the job command)")
