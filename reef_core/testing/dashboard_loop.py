"""A cheap learning loop for dashboard tests: a harness trainer that reports a reward and a loss per step, and a
gate policy that rejects every other candidate with a reason (so a chain holds both outcomes).

Named by dotted path: ``recipe.trainer=reef_core.testing.dashboard_loop:RewardTrainer``,
``evaluation.policy=reef_core.testing.dashboard_loop:EveryOther``.
"""

from __future__ import annotations

from ..commit.gate import Decision
from ..grow.trainer import CandidateUpdate, Trainer


class RewardTrainer(Trainer):
    """Each step writes ``system_prompt.md`` and reports the batch's mean reward and a falling loss."""

    artifact_kind = "harness"

    def __init__(self, **_):
        pass

    def initial_files(self):
        return {"system_prompt.md": b"step 0"}

    def train(self, batch, ctx):
        rewards = [s.reward for s in batch.samples if isinstance(getattr(s, "reward", None), (int, float))]
        metrics = {"reward_mean": sum(rewards) / len(rewards) if rewards else 0.0, "loss": 1.0 / (ctx.step + 1)}
        return CandidateUpdate(files={"system_prompt.md": f"step {ctx.step}".encode()}, metrics=metrics)


class EveryOther:
    """Selects candidates of even steps and rejects those of odd ones (the policy is built anew per candidate)."""

    name = "every_other"
    version = "1"

    def __init__(self, **_):
        pass

    def decide(self, candidate, evaluation) -> Decision:
        step = int((candidate.metadata or {}).get("step", 0))
        select = step % 2 == 0
        reason = f"step {step} is even: selected (test policy)" if select else \
            f"step {step} is odd: rejected (test policy)"
        return Decision("select" if select else "reject", self.name, reason, evaluation, {})
