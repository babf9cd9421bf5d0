"""FakeSlime: a FAKE slime training job for CPU tests, following the job directory and marker protocol.

slime needs NVIDIA GPUs, Megatron and Ray (``ecosystem-notes.md`` §5), so CPU tests run this stand-in as
``trainer.slime.launch: [python, -m, reef_core.testing.fake_slime]`` (Reef appends the job directory). It plays
slime's ``train.py`` for a Reef job, then the rest of ``deploy/slime/launch.sh`` (:mod:`reef_core.grow.slime.finish`).
Checked against THUDM/slime ``624b824a898ab0ec1fcb4d373004c7f3852bf515`` (:data:`SLIME_COMMIT`; the files are named
in :mod:`reef_core.config.slime_args`), it does what the real one does on these points:

* **Parsing**: the arguments of ``job.json``, every flag of slime's list accepted; a flag slime does not know is
  ignored, as slime's parser (Megatron's ``parse_args(ignore_unknown_args=True)``) ignores it (Reef refuses those
  itself, :func:`reef_core.grow.slime.flags.check_argv`). ``--rollout-batch-size`` is required, ``--num-rollout``
  or ``--num-epoch`` must be set, ``--save-interval`` needs ``--save`` (``slime_validate_args``).
* **Model set-up**: ``--load`` is read as an HF directory when it holds a ``config.json`` of a model type slime's
  ``hf_to_megatron`` loads; otherwise ``--load`` becomes ``--ref-load``, and with neither the assertion of
  ``setup_model_and_optimizer`` fails (``AssertionError``). The weights come from that directory, the tokenizer
  from ``--hf-checkpoint``; a Megatron checkpoint is refused (the fake cannot read one).
* **Saving**: after the rollout's step the model is saved only when ``should_run_periodic_action(rollout_id,
  --save-interval, ...)`` holds (never without ``--save-interval``): a placeholder Megatron checkpoint under
  ``--save`` (``latest_checkpointed_iteration.txt`` only) and the HF checkpoint under
  ``--save-hf.format(rollout_id=...)``, as shards plus index like slime's writer. Without it ``finish`` finds no
  checkpoint and fails, and the marker stays ``RUNNING``.

Training is Reef's torch backend on the tiny model, ONE step: a custom-loss family as slime would run it (the
function named by ``--custom-advantage-function-path`` fills the advantages from the rollout file, the one named by
``--custom-loss-function-path`` (``reef_slime_hooks``) computes the loss on slime-format micro-batches
(:mod:`reef_core.testing.slime_batch`), divided by the step's token count as ``--calculate-per-token-loss`` does).
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
#: The slime commit this fake was checked against (the one :mod:`reef_core.config.slime_args` was read from).
SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"


class ReinforceObjective(Objective):
    """A REINFORCE objective for tests, loss family ``policy`` (slime's built-in policy loss): ``-Σ r·logπ / tokens``."""

    name = "policy"
    slime_loss = "policy_loss"

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
    from reef_core.config.slime_args import KNOWN

    p = argparse.ArgumentParser(prog="fake-slime", add_help=False, allow_abbrev=False)
    # The flags the fake reads, typed and defaulted as slime's parser does; every other known flag is accepted.
    p.add_argument("--debug-train-only", action="store_true")
    p.add_argument("--load-debug-rollout-data", required=True)  # the fake runs Reef's jobs only
    p.add_argument("--hf-checkpoint")
    p.add_argument("--load")
    p.add_argument("--ref-load")
    p.add_argument("--save")
    p.add_argument("--save-interval", type=int)
    p.add_argument("--save-hf")
    p.add_argument("--num-rollout", type=int)
    p.add_argument("--num-epoch", type=int)
    p.add_argument("--start-rollout-id", type=int)
    p.add_argument("--rollout-batch-size", type=int, required=True)
    p.add_argument("--n-samples-per-prompt", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--loss-type", choices=["policy_loss", "sft_loss", "custom_loss"], default="policy_loss")
    p.add_argument("--custom-loss-function-path")
    p.add_argument("--custom-advantage-function-path")
    p.add_argument("--use-rollout-logprobs", action="store_true")
    p.add_argument("--calculate-per-token-loss", action="store_true")
    typed = {a for action in p._actions for a in action.option_strings}
    for flag in sorted(KNOWN - typed):
        p.add_argument(flag, nargs="?", const=True)
    return p


def _validate(args) -> None:
    """What ``slime_validate_args`` asserts about the arguments the fake reads."""
    if args.num_rollout is None and args.num_epoch is None:
        raise AssertionError("num_epoch is not set, but num_rollout is not set, please set --num-rollout or --num-epoch")
    if args.save_interval is not None and args.save is None:
        raise AssertionError("'--save' is required when save_interval is set.")
    if args.loss_type == "custom_loss" and not args.custom_loss_function_path:
        raise SystemExit("fake-slime: --loss-type custom_loss needs --custom-loss-function-path")


def _model_type(path: str) -> str | None:
    config = Path(path) / "config.json"
    return json.loads(config.read_text()).get("model_type") if config.is_file() else None


def _model_dir(args) -> str:
    """The directory slime sets the policy up from (``slime_validate_args``, ``setup_model_and_optimizer``,
    ``load_checkpoint``)."""
    from reef_core.config.slime_args import HF_MODEL_TYPES

    load = args.load
    megatron = load is not None and (Path(load) / "latest_checkpointed_iteration.txt").exists()
    hf = load is not None and Path(load).is_dir() and _model_type(load) in HF_MODEL_TYPES
    if not megatron and not hf:
        load = args.ref_load
    if load is None:
        raise AssertionError("assert args.load is not None or args.pretrained_checkpoint is not None "
                             "(setup_model_and_optimizer: neither --load nor --ref-load names a checkpoint)")
    if not (Path(load).is_dir() and any(Path(load).iterdir())):
        raise AssertionError(f"args.load={load!r} does not exist or is an empty directory.")
    if (Path(load) / "latest_checkpointed_iteration.txt").exists():
        raise SystemExit(f"fake-slime: {load} is a Megatron checkpoint, which the fake cannot read")
    if _model_type(load) not in HF_MODEL_TYPES:
        raise ValueError(f"Unsupported HuggingFace model type: {_model_type(load)}")
    return load


def _saves(rollout_id: int, interval: int | None, num_rollout: int) -> bool:
    """slime's ``should_run_periodic_action`` as ``train.py`` calls it for the save."""
    if interval is None:
        return False
    return rollout_id == num_rollout - 1 or (rollout_id + 1) % interval == 0


def _save(args, rollout_id: int, files: dict[str, bytes]) -> None:
    """slime's ``save_model``: the Megatron save (a placeholder), then ``--save-hf`` as one shard plus index."""
    from safetensors.torch import load as load_safetensors

    from reef_core.models.release_files import MODEL_FILE

    megatron = Path(args.save)
    megatron.mkdir(parents=True, exist_ok=True)
    (megatron / "latest_checkpointed_iteration.txt").write_text(str(rollout_id))
    if args.save_hf is None:
        return
    out = Path(args.save_hf.format(rollout_id=rollout_id))
    out.mkdir(parents=True, exist_ok=True)
    shard = "model-00001-of-00001.safetensors"
    for name, data in files.items():
        path = out / (shard if name == MODEL_FILE else name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    tensors = load_safetensors(files[MODEL_FILE])
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {name: shard for name in sorted(tensors)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


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
    """One job: slime's ``train.py`` (one rollout, one torch step, the save), then ``finish`` (manifest, marker
    ``CHECKPOINT``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reef_core.grow.slime import jobs
    from reef_core.grow.slime.finish import finish
    from reef_core.grow.slime.marker import CHECKPOINT, RUNNING, read_marker
    from reef_core.grow.token_batch import TokenBatch
    from reef_core.grow.torch_backend import TorchTrainer, TorchTrainerOptions

    job_dir = Path(job_dir)
    job = json.loads((job_dir / jobs.JOB).read_text())
    args, unknown = _parser().parse_known_args(job["slime_args"])
    if unknown:  # slime drops them too, without a word
        print(f"fake-slime: ignoring unknown arguments, as slime does: {' '.join(unknown)}", file=sys.stderr)
    _validate(args)
    marker = read_marker(job_dir)
    if marker is None or marker["phase"] != RUNNING or marker["job_id"] != job["job_id"]:
        raise SystemExit(f"fake-slime: job {job['job_id']} is not RUNNING ({marker and marker['phase']})")
    model_dir = _model_dir(args)
    samples = torch.load(args.load_debug_rollout_data.format(rollout_id=0), weights_only=False)["samples"]
    if args.loss_type == "custom_loss":
        if not (args.use_rollout_logprobs and args.calculate_per_token_loss):
            raise SystemExit("fake-slime: Reef's custom losses need --use-rollout-logprobs --calculate-per-token-loss")
        objective = HookObjective(args, samples)
    else:
        objective = torch.load(job_dir / jobs.OBJECTIVE, weights_only=False)
    tokenizer_dir = args.hf_checkpoint or model_dir

    def load():
        return AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(tokenizer_dir)

    trainer = TorchTrainer(objective, load,
                           TorchTrainerOptions(lr=args.lr, device="cpu", seed=args.seed, name="fake-slime"))
    trainer.load()
    _crash_if(RUNNING)
    start = args.start_rollout_id or 0  # slime starts at 0 when --load is not a Megatron checkpoint
    if args.num_rollout is None or args.num_rollout - start != 1:
        raise SystemExit("fake-slime: trains one rollout (Reef's jobs pass --num-rollout 1)")
    metrics = {}
    for rollout_id in range(start, args.num_rollout):
        update = trainer.step(TokenBatch.from_rows(_rows(samples), pad_token_id=trainer.pad_token_id))
        if update is None:
            raise SystemExit("fake-slime: the objective produced no update")
        metrics = {k: v for k, v in update.metrics.items() if isinstance(v, (int, float, str, bool)) or v is None}
        if _saves(rollout_id, args.save_interval, args.num_rollout):
            _save(args, rollout_id, {name: bytes(update.files[name]) for name in update.files})
    (job_dir / jobs.METRICS).write_text(json.dumps(metrics))
    finish(job_dir)  # launch.sh's last step; it fails when train.py saved no HF checkpoint
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
