"""A harness trainer for multi-process tests: every step writes which records it trained on.

Named by its dotted path (``recipe.trainer=reef_core.testing.step_trainer:StepTrainer``), so a ``reef learn`` or
``reef serve`` subprocess loads it without a plugin. Release ``system_prompt.md`` reads ``step <N>: <record ids>``.

``REEF_TEST_STEP_DIR`` (optional): before training, the trainer writes ``<pid>-<step>.started`` there, then waits
``REEF_TEST_STEP_DELAY_S`` seconds (default 0) so a test can kill the process mid-step, then writes
``<pid>-<step>.trained`` listing the batch's record ids.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..grow.trainer import CandidateUpdate, Trainer


class StepTrainer(Trainer):
    artifact_kind = "harness"

    def __init__(self, **_):
        marker_dir = os.environ.get("REEF_TEST_STEP_DIR")
        self.marker_dir = Path(marker_dir) if marker_dir else None
        self.delay_s = float(os.environ.get("REEF_TEST_STEP_DELAY_S", "0"))

    def initial_files(self):
        return {"system_prompt.md": b"step 0"}

    def train(self, batch, ctx):
        ids = list(batch.record_ids)
        if self.marker_dir is not None:
            stem = self.marker_dir / f"{os.getpid()}-{ctx.step}"
            stem.with_suffix(".started").write_text(json.dumps(ids))
            time.sleep(self.delay_s)
            stem.with_suffix(".trained").write_text(json.dumps(ids))
        return CandidateUpdate(files={"system_prompt.md": f"step {ctx.step}: {' '.join(ids)}".encode()})
