"""A slime job's directory: what Reef writes for the job and what the job writes back.

Layout of ``<jobs_dir>/<scenario key>/step-<step>-<job id>/``:

* ``job.json``: job id, scenario, step, the batch's record ids, the objective (loss family), the slime arguments.
* ``rollout.pt``: the batch in slime's rollout-dump format (``torch.save({"rollout_id", "samples"})`` of
  ``Sample.to_dict()`` fields: ``tokens``, ``response_length``, ``loss_mask`` and ``rollout_log_probs`` over the
  response, ``reward``, ``index``, ``status``), which ``--load-debug-rollout-data`` reads. For a custom-loss family
  every sample also holds ``advantages`` (the recipe's, over the response; slime keeps unknown keys as attributes
  and ``reef_slime_hooks.reef_advantages`` reads them back) and the file a ``reef`` header (the family, its
  constants, the loss scale: see ``reef_slime_hooks``).
* ``input/``: the HF checkpoint the step starts from (the serving release), ``--hf-checkpoint``.
* ``checkpoint/`` + ``checkpoint.json``: written by the job (``--save-hf``), then the sha256 of every file.
* ``megatron/``: the Megatron checkpoint slime's save step writes beside ``--save-hf`` (``--save``); never read.
* ``metrics.json`` (optional, by the job) and ``marker.json`` (:mod:`reef_core.grow.slime.marker`).
* ``objective_state.safetensors`` (custom-loss families with tensor state, e.g. SAO's critic after this step's
  preparation): becomes the candidate's ``algorithm/<objective>.safetensors``, so an adopted job carries it too.
* ``objective.pt``: slime's built-in families only (``policy``, ``sft``): the pickled objective, read only by the
  fake driver, standing in for slime's built-in loss (a custom-loss family runs its ``reef_slime_hooks`` function).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

from .marker import fsync_dir, write_atomic

JOB = "job.json"
ROLLOUT = "rollout.pt"
INPUT = "input"
CHECKPOINT_DIR = "checkpoint"
MEGATRON_DIR = "megatron"
MANIFEST = "checkpoint.json"
METRICS = "metrics.json"
OBJECTIVE = "objective.pt"
OBJECTIVE_STATE = "objective_state.safetensors"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def slime_samples(token_batch: Any, advantages: Any = None) -> list[dict]:
    """The rows of a :class:`~reef_core.grow.token_batch.TokenBatch` as slime ``Sample`` dicts (unpadded);
    ``advantages`` ``[B, L]`` (per token, aligned to the batch) adds each row's response part."""
    out = []
    for i in range(token_batch.size):
        n = int(token_batch.attention_mask[i].sum())
        start = int(token_batch.response_starts[i])
        extra = {} if advantages is None else {"advantages": [float(x) for x in advantages[i, start:n].tolist()]}
        out.append({
            "status": "completed",
            "index": i,
            "group_index": i,
            "tokens": token_batch.input_ids[i, :n].tolist(),
            "response_length": n - start,
            "loss_mask": [int(x) for x in token_batch.action_mask[i, start:n].tolist()],
            "rollout_log_probs": token_batch.rollout_logprobs[i, start:n].tolist(),
            "reward": float(token_batch.rewards[i]),
            "metadata": {"reef_sample_id": token_batch.sample_ids[i] if token_batch.sample_ids else None,
                         "reef_group": token_batch.group_keys[i] if token_batch.group_keys else None},
            "weight_versions": [v for v in (token_batch.versions[i] if token_batch.versions else []) if v],
            **extra,
        })
    return out


def write_files(directory: Path, files: Mapping[str, bytes]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(data))


def write_manifest(job_dir: Path) -> dict[str, str]:
    """The job side (``finish``): fsync every file of ``checkpoint/``, then write the manifest of their sha256 (what Reef checks on reading)."""
    final = job_dir / CHECKPOINT_DIR
    paths = sorted(p for p in final.rglob("*") if p.is_file())
    for path in paths:
        with open(path, "rb+") as fh:
            os.fsync(fh.fileno())
    fsync_dir(final)
    fsync_dir(job_dir)
    manifest = {p.relative_to(final).as_posix(): sha256_file(p) for p in paths}
    write_atomic(job_dir / MANIFEST, json.dumps(manifest, sort_keys=True).encode())
    return manifest


def read_checkpoint(job_dir: Path) -> dict[str, bytes]:
    """The checkpoint's files, each checked against the manifest (a torn or foreign checkpoint raises)."""
    manifest = json.loads((job_dir / MANIFEST).read_text())
    root = job_dir / CHECKPOINT_DIR
    files = {}
    for name, digest in manifest.items():
        path = root / name
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"{path}: checksum differs from {MANIFEST}")
        files[name] = data
    return files


def cleanup(job_dir: Path) -> None:
    """Drop what a finished job no longer needs (inputs, batch, checkpoint); the job and marker files stay."""
    for name in (ROLLOUT, OBJECTIVE, OBJECTIVE_STATE, INPUT, CHECKPOINT_DIR, MEGATRON_DIR, f".{CHECKPOINT_DIR}.tmp"):
        path = job_dir / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()
