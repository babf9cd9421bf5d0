"""``python -m reef_core.grow.slime.finish <job dir>``: the cluster side's last step after slime's ``train.py``.

slime writes the HF checkpoint to ``--save-hf`` (the job's ``checkpoint/``) in its save step (``--save-interval 1``
makes the job's one rollout save) and exits; this command, run by the
launch script only when ``train.py`` succeeded, merges a sharded checkpoint into the one ``model.safetensors`` the
weights surface loads, writes the manifest (sha256 of every file) and moves the marker from ``RUNNING`` to
``CHECKPOINT``. It refuses a job whose marker is not ``RUNNING`` (a job Reef abandoned meanwhile).
"""

from __future__ import annotations

import sys
from pathlib import Path

from . import jobs
from .marker import CHECKPOINT, RUNNING, read_marker, write_marker


def merge_shards(checkpoint: Path) -> None:
    """``model-0000i-of-0000n.safetensors`` + index -> ``model.safetensors`` (nothing to do when already one file)."""
    if (checkpoint / "model.safetensors").exists():
        return
    shards = sorted(checkpoint.glob("model-*-of-*.safetensors"))
    if not shards:
        raise SystemExit(f"{checkpoint}: no model.safetensors and no shards")
    from safetensors.torch import load_file, save_file

    tensors = {}
    for shard in shards:
        tensors.update(load_file(str(shard)))
    save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    for shard in shards:
        shard.unlink()
    (checkpoint / "model.safetensors.index.json").unlink(missing_ok=True)


def finish(job_dir: Path) -> None:
    marker = read_marker(job_dir)
    if marker is None or marker["phase"] != RUNNING:
        raise SystemExit(f"{job_dir}: the job is not RUNNING ({marker and marker['phase']}); leaving it alone")
    checkpoint = job_dir / jobs.CHECKPOINT_DIR
    merge_shards(checkpoint)
    jobs.write_manifest(job_dir)
    write_marker(job_dir, CHECKPOINT, checkpoint=str(checkpoint))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m reef_core.grow.slime.finish <job dir>")
    finish(Path(sys.argv[1]))
