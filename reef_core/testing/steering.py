"""Test support: steer a tiny model so its replies use only two chosen letters.

The gate tests need candidates that are reliably better or worse than what serves. :func:`steer` rewrites
the weights so that the final norm keeps a single hidden dimension and the output embeddings read only that
dimension, for two letter tokens (+scale, -scale): whatever the prompt, one of the two letters has the top
logit, and the reply repeats it. With vowels the SAO verifier scores such a reply 1.0, with consonants 0.0.

:func:`make_steered_trainer` (a ``recipe.trainer`` given by dotted path, for ``reef serve`` in a
subprocess) builds the trainer factory named by ``REEF_TEST_STEER_TRAINER`` (a dotted path, e.g.
``reef_sao.trainer:make_sao_trainer``), lets it train as usual, and then steers its n-th candidate by the
n-th entry of ``REEF_TEST_STEER`` (comma-separated letter pairs, e.g. ``zx,ae``; an empty entry leaves the
candidate as the recipe made it). It reaches into :class:`TorchTrainer`'s export helpers: test code only.
"""

from __future__ import annotations

import os

import torch


def steer(model, tokenizer, letters: str, scale: float = 50.0, dim: int = 0) -> None:
    """Make ``model``'s greedy replies repeat ``letters[0]`` or ``letters[1]`` (in place)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    first, second = (tokenizer.convert_tokens_to_ids(c) for c in letters[:2])
    with torch.no_grad():
        norm = base.model.norm.weight
        norm.zero_()
        norm[dim] = 1.0
        out = base.get_output_embeddings().weight
        out[:, dim] = 0.0
        out[first, dim] = scale
        out[second, dim] = -scale


class SteeredTrainer:
    """Delegates to a TorchTrainer; after each step, steers the candidate by the next planned letter pair."""

    def __init__(self, inner, plan: list[str]):
        self.inner = inner
        self.plan = plan
        self.candidates = 0
        self.artifact_kind = inner.artifact_kind

    def train(self, batch, ctx):
        update = self.inner.train(batch, ctx)
        if update is None:
            return None
        letters = self.plan[self.candidates] if self.candidates < len(self.plan) else ""
        self.candidates += 1
        if letters:
            steer(self.inner.policy, self.inner.tokenizer, letters)
            payload = self.inner._payload()
            update.payload = payload
            update.files = self.inner._files(payload)
            update.metrics["steered"] = letters
        return update

    def __getattr__(self, name):
        return getattr(self.inner, name)


def make_steered_trainer(**kwargs):
    """The trainer factory named by ``REEF_TEST_STEER_TRAINER``, steered by ``REEF_TEST_STEER`` (module docstring)."""
    from reef_core.dotted import load_object

    inner = load_object(os.environ["REEF_TEST_STEER_TRAINER"])(**kwargs)
    plan = [p.strip() for p in os.environ.get("REEF_TEST_STEER", "").split(",")]
    return SteeredTrainer(inner, plan)
