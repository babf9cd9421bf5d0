"""A string-scored toy problem for CPU tests: write text made of the letters of an alphabet (default: vowels).

A state is text; its score is the fraction of its characters in the alphabet (0 for empty text). The reward is
dense, so even the tiny random-init test model gets a signal from its first rollouts; the archive's best climbs as
soon as one rollout beats the seeds.
"""

from __future__ import annotations

from typing import Any


class Vowels:
    """Task object (see :mod:`reef_ttt.task`)."""

    def __init__(self, alphabet: str = "aeiou"):
        if not isinstance(alphabet, str) or not alphabet:
            raise ValueError("alphabet must be non-empty text")
        self.alphabet = alphabet
        self.name = "vowels"

    def seeds(self) -> list[Any]:
        return ["xyz"]

    def score(self, state: Any) -> float | None:
        if not isinstance(state, str):
            return None
        if not state:
            return 0.0
        return sum(ch in self.alphabet for ch in state) / len(state)

    def prompt(self, state: Any, value: float, *, guidance: bool = False) -> list[dict]:
        return [{"role": "user", "content": f"Use only the letters {self.alphabet}. Improve on: {state}"}]

    def state_from_reply(self, text: str) -> Any:
        return text


def make_task(alphabet: str = "aeiou") -> Vowels:
    return Vowels(alphabet)
