"""Test support: steer a tiny model so its replies use only two chosen letters.

The gate tests need candidates that are reliably better or worse than what serves. :func:`steer` rewrites
the (tied) embeddings so that one hidden dimension carries a large positive constant through the residual
stream (every token embeds ``scale`` there, the two letters ``2 * scale``), and the final norm keeps only
that dimension: whatever the prompt, the two letters out-score every other token by about
``sqrt(hidden_size) * scale`` logits, and the reply is made of them, greedy or sampled. With vowels the SAO
verifier scores such a reply 1.0, with consonants 0.0.

:class:`SteeredTrainer` wraps a recipe's trainer (a :class:`TorchTrainer`): it trains as usual, then steers its
n-th candidate by the n-th entry of its plan (a letter pair; an empty entry leaves the candidate as the recipe made
it). It reaches into :class:`TorchTrainer`'s export helpers: test code only.
"""

from __future__ import annotations

import torch


def steer(model, tokenizer, letters: str, scale: float = 10.0, dim: int = 0) -> None:
    """Make ``model`` reply with ``letters[0]`` and ``letters[1]`` only (in place; see the module docstring)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    first, second = (tokenizer.convert_tokens_to_ids(c) for c in letters[:2])
    with torch.no_grad():
        norm = base.model.norm.weight
        norm.zero_()
        norm[dim] = 1.0
        out = base.get_output_embeddings().weight  # tied: the input embeddings too
        out[:, dim] = scale
        out[first, dim] = 2 * scale
        out[second, dim] = 2 * scale


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
