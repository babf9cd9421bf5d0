"""Trainers for tests that need releases on demand from a real server.

``recipe.trainer=reef_core.testing.trainers:FeedbackTreeTrainer`` (a dotted path, so a spawned ``reef serve``
finds it) makes the harness tree a report asks for the next release: a report whose ``feedback`` is
``{"tree": {path: text}}`` trains into exactly that tree. A report without one trains into nothing. A batch carrying a
person's instruction (``POST /reef/train``) trains into ``{"INSTRUCTIONS.md": its text}``.
"""

from __future__ import annotations

from reef_core.grow.trainer import CandidateUpdate, Trainer


class FeedbackTreeTrainer(Trainer):
    """Proposes the tree the batch's newest report names in ``feedback.tree``."""

    artifact_kind = "harness"

    def __init__(self, **_context):
        pass

    def train(self, batch, ctx):
        if batch.instructions:
            return CandidateUpdate(files={"INSTRUCTIONS.md": "\n".join(i["text"] for i in batch.instructions).encode()})
        for sample in reversed(batch.samples):
            feedback = sample.feedback
            if isinstance(feedback, dict) and isinstance(feedback.get("tree"), dict):
                return CandidateUpdate(files={p: str(t).encode("utf-8") for p, t in feedback["tree"].items()})
        return None
