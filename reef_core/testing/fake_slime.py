"""FakeSlime: a FAKE slime training job for CPU tests, following the job directory and marker protocol.

slime needs NVIDIA GPUs, Megatron and Ray (``ecosystem-notes.md`` §5), so CPU tests run this stand-in as
``trainer.slime.launch: [python, -m, reef_core.testing.fake_slime]`` (Reef appends the job directory). It does what a
real job does with the same files (:mod:`reef_core.grow.slime.jobs`):

* parses the slime arguments of ``job.json`` the way slime's parser would for the flags Reef sets (the rollout
  dump, ``--hf-checkpoint``, ``--save-hf``, ``--loss-type`` with ``--custom-loss-function-path``, ``--lr``) and
  refuses a flag it does not know;
* checks the marker is ``RUNNING`` for this job, loads the rollout dump and the input HF checkpoint;
* trains ONE step with Reef's torch backend and writes the HF checkpoint, its manifest and ``metrics.json``, then
  moves the marker to ``CHECKPOINT``. A custom-loss family trains as slime would: the function named by
  ``--custom-advantage-function-path`` fills the advantages from the rollout file and the one named by
  ``--custom-loss-function-path`` (``reef_slime_hooks``) computes the loss on slime-format micro-batches
  (:mod:`reef_core.testing.slime_batch`), divided by the step's token count as ``--calculate-per-token-loss`` does.
  slime's built-in ``policy_loss``/``sft_loss`` are not re-implemented: the pickled objective in ``objective.pt``
  stands in for them.

Crash injection: ``REEF_FAKE_SLIME_CRASH=RUNNING`` kills the job (status 137, no clean-up) after it loaded its
inputs and before any checkpoint; ``REEF_FAKE_SLIME_CRASH=CHECKPOINT`` kills it right after the marker reached
``CHECKPOINT``. :func:`run_job` is the same job in-process, for tests whose crash is on Reef's side.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from reef_core.grow.objective import Objective, Prepared, sequence_logprobs, token_sum

CRASH_ENV = "REEF_FAKE_SLIME_CRASH"


class ReinforceObjective(Objective):
    """A REINFORCE objective for tests, loss family ``policy`` (slime's built-in policy loss): ``-Σ r·logπ / tokens``."""

    name = "policy"

    def prepare(self, policy, batch):
        return Prepared(batch=batch.with_extras(advantages=batch.rewards.unsqueeze(1) * batch.action_mask))

    def loss(self, policy, batch, prepared):
        logp = sequence_logprobs(policy, batch)
        mask = batch.action_mask > 0
        loss = -token_sum(batch.extras["advantages"] * logp, mask) / batch.norm_tokens
        return loss, {"tokens": float(mask.sum())}


class HookObjective(Objective):
    """slime's custom-loss step around Reef's hooks, as an objective of the torch backend (FAKE: one rank, one
    micro-batch)."""

    name = "slime-custom-loss"

    def __init__(self, args, samples: list[dict]):
        self.args, self.samples = args, samples
        self.advantage_fn = _load_function(args.custom_advantage_function_path)
        self.loss_fn = _load_function(args.custom_loss_function_path)

    def prepare(self, policy, batch):
        from reef_core.testing import slime_batch

        data = slime_batch.rollout_data(self.samples)
        if self.advantage_fn is not None:
            self.advantage_fn(self.args, data)
        return Prepared(batch=batch, data={"rollout": data})

    def loss(self, policy, batch, prepared):
        from reef_core.testing import slime_batch

        data = prepared.data["rollout"]
        micro = slime_batch.micro_batch(data)
        logits = slime_batch.packed_logits(policy, micro)
        loss, log = self.loss_fn(self.args, micro, logits, slime_batch.sum_of_sample_mean(micro))
        return loss / slime_batch.step_tokens(data), {k: float(v) for k, v in log.items()}


def _load_function(path: str | None):
    """slime's ``load_function``: ``module.attribute``."""
    if not path:
        return None
    import importlib

    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _parser() -> argparse.ArgumentParser:
    from reef_core.grow.slime.flags import ALLOWED

    p = argparse.ArgumentParser(prog="fake-slime", add_help=False)
    p.add_argument("--debug-train-only", action="store_true")
    p.add_argument("--load-debug-rollout-data", required=True)
    p.add_argument("--hf-checkpoint", required=True)
    p.add_argument("--save-hf", required=True)
    p.add_argument("--num-rollout", type=int, default=1)
    p.add_argument("--rollout-batch-size", type=int, required=True)
    p.add_argument("--n-samples-per-prompt", type=int, default=1)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--loss-type", choices=["policy_loss", "sft_loss", "custom_loss"], required=True)
    p.add_argument("--custom-loss-function-path")
    p.add_argument("--custom-advantage-function-path")
    p.add_argument("--use-rollout-logprobs", action="store_true")
    for flag in sorted(ALLOWED - {"--seed"}):
        p.add_argument(flag, nargs="?", const=True)
    p.add_argument("--seed", type=int, default=1234)
    return p


def _crash_if(phase: str) -> None:
    if os.environ.get(CRASH_ENV) == phase:
        os._exit(137)


def _rows(samples: list[dict]):
    from reef_core.grow.token_batch import TokenRow

    rows = []
    for s in samples:
        n, r = len(s["tokens"]), int(s["response_length"])
        start = n - r
        rows.append(TokenRow(input_ids=list(s["tokens"]), action_mask=[0] * start + list(s["loss_mask"]),
                             rollout_logprobs=[0.0] * start + list(s["rollout_log_probs"]),
                             reward=float(s["reward"]), response_start=start))
    return rows


def run_job(job_dir: str | Path) -> None:
    """One job: RUNNING -> (one torch step) -> checkpoint -> CHECKPOINT."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reef_core.grow.slime import jobs
    from reef_core.grow.slime.marker import CHECKPOINT, RUNNING, read_marker, write_marker
    from reef_core.grow.token_batch import TokenBatch
    from reef_core.grow.torch_backend import TorchTrainer

    job_dir = Path(job_dir)
    job = json.loads((job_dir / jobs.JOB).read_text())
    args, unknown = _parser().parse_known_args(job["slime_args"])
    if unknown:
        raise SystemExit(f"fake-slime: unrecognized arguments: {' '.join(unknown)}")
    if args.loss_type == "custom_loss" and not args.custom_loss_function_path:
        raise SystemExit("fake-slime: --loss-type custom_loss needs --custom-loss-function-path")
    marker = read_marker(job_dir)
    if marker is None or marker["phase"] != RUNNING or marker["job_id"] != job["job_id"]:
        raise SystemExit(f"fake-slime: job {job['job_id']} is not RUNNING ({marker and marker['phase']})")
    samples = torch.load(args.load_debug_rollout_data, weights_only=False)["samples"]
    if args.loss_type == "custom_loss":
        if not (args.use_rollout_logprobs and args.calculate_per_token_loss):
            raise SystemExit("fake-slime: Reef's custom losses need --use-rollout-logprobs --calculate-per-token-loss")
        objective = HookObjective(args, samples)
    else:
        objective = torch.load(job_dir / jobs.OBJECTIVE, weights_only=False)
    hf_in = args.hf_checkpoint

    def load():
        return AutoModelForCausalLM.from_pretrained(hf_in), AutoTokenizer.from_pretrained(hf_in)

    trainer = TorchTrainer(objective, load, lr=args.lr, device="cpu", seed=args.seed, name="fake-slime")
    trainer.load()
    _crash_if(RUNNING)
    update = trainer.step(TokenBatch.from_rows(_rows(samples), pad_token_id=trainer.pad_token_id))
    if update is None:
        raise SystemExit("fake-slime: the objective produced no update")
    files = {name: bytes(update.files[name]) for name in update.files}
    jobs.write_checkpoint(job_dir, files)
    metrics = {k: v for k, v in update.metrics.items() if isinstance(v, (int, float, str, bool)) or v is None}
    (job_dir / jobs.METRICS).write_text(json.dumps(metrics))
    write_marker(job_dir, CHECKPOINT, checkpoint=str(job_dir / jobs.CHECKPOINT_DIR))
    _crash_if(CHECKPOINT)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m reef_core.testing.fake_slime <job dir>", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    run_job(argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
