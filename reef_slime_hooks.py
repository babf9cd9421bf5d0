"""Reef's hooks for slime (``trainer.backend=slime``): the custom-loss families and the advantage loader.

This module runs inside slime's training processes on the cluster, so it imports only torch and the standard
library (slime's own log-prob helper is imported when slime is installed; never the ``reef_core`` package, whose
``__init__`` needs the host's dependencies). The loss terms themselves are Reef's one implementation,
``reef_core/grow/losses.py`` (torch only, by its own rule), loaded from its file under a private module name
(:data:`losses`, read when this module is imported) without importing the package around it.

How a Reef job reaches these hooks (``reef_core/grow/slime/flags.py`` builds the arguments):

* ``--custom-advantage-function-path reef_slime_hooks.reef_advantages``: slime's dump loader keeps only the fields
  of its ``Sample``, so the recipe's per-token advantages (computed by the objective's ``prepare`` in Reef's
  learner) cannot reach the batch on their own; this function re-reads them from the job's rollout file
  (``--load-debug-rollout-data``, key ``advantages`` of every sample, over its response tokens) and sets
  ``rollout_data["advantages"]`` (and ``["returns"]``, the same tensors), one tensor per sample in slime's layout.
* ``--loss-type custom_loss --custom-loss-function-path reef_slime_hooks.<family>_loss``: one function per loss
  family with slime's signature ``(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)``. Each computes the
  policy's log-probs of the response tokens from ``logits`` and the family's per-token loss against
  ``batch["rollout_log_probs"]`` (the engine's, ``--use-rollout-logprobs``) and ``batch["advantages"]``.

Scale: Reef sets ``--calculate-per-token-loss``, so slime sums the per-token loss over the micro-batches and divides
by the step's token count ``N = Σ_samples max(mask tokens, 1)``. Reef's objectives divide by their own normaliser
``D`` (the batch's action tokens for the DIS families and OpenClaw, 1 for TTT's token sum), so the rollout file's
header carries ``loss_scale = N / D`` and every hook multiplies its sum by it: slime's step then equals Reef's.

The rollout file's header (``torch.load(path)["reef"]``): ``family``, ``loss_scale`` and the family's constants
(``eps_clip``, ``eps_clip_high``, ``w_rl``).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
from torch import Tensor

HEADER = "reef"

Reducer = Callable[[Tensor], Tensor]


def _reef_losses() -> ModuleType:
    """``reef_core/grow/losses.py`` (torch only) as the private module ``reef_slime_hooks._losses``: located with
    ``find_spec("reef_core")``, which finds the package without running its ``__init__``."""
    name = f"{__name__}._losses"
    if name in sys.modules:
        return sys.modules[name]
    package = importlib.util.find_spec("reef_core")
    if package is None or not package.submodule_search_locations:
        raise ImportError("reef_slime_hooks needs reef-core installed next to it (its reef_core/grow/losses.py)")
    path = Path(next(iter(package.submodule_search_locations))) / "grow" / "losses.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


losses = _reef_losses()


# --------------------------------------------------------------------------------------------------- the job


@functools.lru_cache(maxsize=4)
def _load(path: str) -> tuple[dict, dict]:
    data = torch.load(path, weights_only=False)
    header = data.get(HEADER)
    if not isinstance(header, dict):
        raise ValueError(f"{path}: no {HEADER!r} header; this rollout file was not written by Reef")
    return header, {int(s["index"]): s for s in data["samples"]}


def _rollout_path(args: Any) -> str:
    path = getattr(args, "load_debug_rollout_data", None)
    if not path:
        raise ValueError("reef_slime_hooks needs --load-debug-rollout-data (the job's rollout file)")
    return str(path).format(rollout_id=0)  # Reef's jobs run one rollout, id 0


def job_header(args: Any, family: str | None = None) -> dict:
    """The rollout file's header; ``family`` must match the one Reef wrote (a hook of another family refuses)."""
    header, _ = _load(_rollout_path(args))
    if family is not None and header.get("family") != family:
        raise ValueError(f"reef_slime_hooks.{family}_loss called for a job of family {header.get('family')!r}")
    return header


def _cp_slice(values: Tensor, total_length: int, response_length: int) -> Tensor:
    """This rank's context-parallel part of a per-response-token tensor (the whole of it without slime)."""
    if importlib.util.find_spec("slime") is None:
        return values
    from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp

    return slice_log_prob_with_cp(values, total_length, response_length)


def reef_advantages(args: Any, rollout_data: dict) -> None:
    """slime's custom advantage function: the recipe's per-token advantages from the rollout file."""
    _, samples = _load(_rollout_path(args))
    like = rollout_data.get("kl") or rollout_data.get("rollout_log_probs") or []
    advantages = []
    for i, index in enumerate(rollout_data["sample_indices"]):
        sample = samples[int(index)]
        response = int(rollout_data["response_lengths"][i])
        values = torch.as_tensor(sample["advantages"], dtype=torch.float32)
        if values.shape != (response,):
            raise ValueError(f"sample {index}: {tuple(values.shape)} advantages for {response} response tokens")
        values = _cp_slice(values, int(rollout_data["total_lengths"][i]), response)
        advantages.append(values.to(like[i].device) if i < len(like) else values)
    rollout_data["advantages"] = advantages
    rollout_data["returns"] = advantages


# --------------------------------------------------------------------------------------------------- log-probs


def _torch_log_probs(args: Any, batch: dict, logits: Tensor) -> list[Tensor]:
    """slime's response log-probs without slime (one rank: no tensor or context parallelism).

    ``logits`` ``[1, T, V]`` holds the batch's sequences packed one after the other; the logits at position
    ``t - 1`` score the token at ``t``. Full-vocabulary ``logit - logsumexp`` in float32, as Reef computes them."""
    flat = logits.squeeze(0).float()
    temperature = float(getattr(args, "rollout_temperature", 1.0) or 1.0)
    if temperature != 1.0:
        flat = flat / temperature
    out, end = [], 0
    for tokens, total, response in zip(batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"]):
        end += int(total)
        start = end - int(response)
        out.append(losses.gather_logprobs(flat[start - 1:end - 1], tokens[-int(response):]))
    return out


def response_log_probs(args: Any, batch: dict, logits: Tensor) -> list[Tensor]:
    """The policy's log-prob of every response token, one tensor per sample (this rank's part under CP).

    Inside slime: slime's own helper (tensor-parallel logits, context parallelism, temperature)."""
    if importlib.util.find_spec("slime") is None:
        return _torch_log_probs(args, batch, logits)
    from slime.backends.megatron_utils.loss import get_log_probs_and_entropy

    _, res = get_log_probs_and_entropy(logits, args=args, unconcat_tokens=batch["unconcat_tokens"],
                                       total_lengths=batch["total_lengths"],
                                       response_lengths=batch["response_lengths"], with_entropy=False)
    return res["log_probs"]


def _inputs(args: Any, batch: dict, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(logp, rollout_logp, advantages)``, each concatenated over the micro-batch's response tokens."""
    if batch.get("advantages") is None:
        raise ValueError("batch has no advantages: run the job with "
                         "--custom-advantage-function-path reef_slime_hooks.reef_advantages")
    if batch.get("rollout_log_probs") is None:
        raise ValueError("batch has no rollout_log_probs: Reef's losses need the engine's own log-probs")
    logp = torch.cat(response_log_probs(args, batch, logits))
    rollout = torch.cat([x.to(logp.device) for x in batch["rollout_log_probs"]]).to(logp.dtype)
    adv = torch.cat([x.to(logp.device) for x in batch["advantages"]]).to(logp.dtype)
    return logp, rollout, adv


def _finish(loss: Any, logits: Tensor, metrics: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
    if not isinstance(loss, Tensor) or loss.grad_fn is None:  # an empty micro-batch still backpropagates
        loss = 0 * logits.sum() + loss
    values = {k: torch.as_tensor(v, dtype=torch.float32, device=logits.device).detach() for k, v in metrics.items()}
    return loss, {"loss": loss.detach().clone(), **values}


# --------------------------------------------------------------------------------------------------- families


def _dis(family: str, args: Any, batch: dict, logits: Tensor, reduce: Reducer) -> tuple[Tensor, dict[str, Tensor]]:
    """SAO's direct double-sided importance sampling: ``ℓ_t = −sg(f(r_t))·A_t·logπ_θ(a_t)``, ``f(r) = r`` inside
    the strict band ``(1 − ε_l, 1 + ε_h)`` and 0 outside, ``r_t = exp(logπ_θ − logπ_rollout)``."""
    header = job_header(args, family)
    eps_low, eps_high = float(header["eps_clip"]), float(header["eps_clip_high"])
    logp, rollout, adv = _inputs(args, batch, logits)
    with torch.no_grad():
        log_ratio = logp.detach() - rollout
        ratio = torch.exp(log_ratio)
        weight = losses.dis_weight(ratio, eps_low, eps_high)
    loss = reduce(-weight * adv * logp) * float(header["loss_scale"])
    # outside the band <=> weight 0 (a ratio is never 0 inside it: eps_clip < 1), as the objective counts it
    return _finish(loss, logits, {"pg_clipfrac": reduce((weight == 0).to(logp.dtype)), "ppo_kl": reduce(-log_ratio)})


def sao_loss(args: Any, batch: dict, logits: Tensor, sum_of_sample_mean: Reducer):
    """Family ``sao``: DIS with the critic's skip-observation GAE advantages (computed by Reef's learner)."""
    return _dis("sao", args, batch, logits, sum_of_sample_mean)


def dis_loss(args: Any, batch: dict, logits: Tensor, sum_of_sample_mean: Reducer):
    """Family ``dis``: DIS with the advantages Reef's objective attached."""
    return _dis("dis", args, batch, logits, sum_of_sample_mean)


def grpo_dis_loss(args: Any, batch: dict, logits: Tensor, sum_of_sample_mean: Reducer):
    """Family ``sao-grpo-dis``: DIS with group-relative advantages."""
    return _dis("sao-grpo-dis", args, batch, logits, sum_of_sample_mean)


def ttt_loss(args: Any, batch: dict, logits: Tensor, sum_of_sample_mean: Reducer):
    """Family ``ttt``: un-clipped importance sampling ``−Σ exp(logπ_θ − logπ_rollout)·A_t`` (A_t with the centred
    KL to the base already folded in by Reef's learner)."""
    header = job_header(args, "ttt")
    logp, rollout, adv = _inputs(args, batch, logits)
    log_ratio = logp - rollout
    loss = sum_of_sample_mean(-torch.exp(log_ratio) * adv) * float(header["loss_scale"])
    return _finish(loss, logits, {"ppo_kl": sum_of_sample_mean(-log_ratio.detach())})


def openclaw_loss(args: Any, batch: dict, logits: Tensor, sum_of_sample_mean: Reducer):
    """Family ``openclaw`` (its RL half, ``w_rl · L_RL``): PPO's clipped surrogate
    ``max(−Aρ, −A·clip(ρ, 1 − ε, 1 + ε_h))`` with ``ρ = exp(clamp(logπ_θ − logπ_rollout, −20, 20))`` and ``A`` the
    turn's reward over its reply. The OPD half needs the student's top-K teacher scores, which slime's batch has
    no place for: Reef refuses ``w_opd > 0`` with this backend."""
    header = job_header(args, "openclaw")
    eps_low, eps_high = float(header["eps_clip"]), float(header["eps_clip_high"])
    logp, rollout, adv = _inputs(args, batch, logits)
    log_ratio = (logp - rollout).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    per_token = losses.clipped_surrogate(adv, ratio, eps_low, eps_high)
    loss = sum_of_sample_mean(per_token) * (float(header["w_rl"]) * float(header["loss_scale"]))
    with torch.no_grad():
        clipfrac = sum_of_sample_mean((ratio.clamp(1.0 - eps_low, 1.0 + eps_high) != ratio).to(logp.dtype))
    return _finish(loss, logits, {"pg_clipfrac": clipfrac, "ppo_kl": sum_of_sample_mean(-log_ratio.detach())})
