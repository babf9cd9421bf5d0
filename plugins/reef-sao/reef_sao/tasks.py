"""The example task stream and its verifier: "answer using only vowels".

Every task asks for a reply written with the letters of an alphabet (default: the vowels ``aeiou``); the verifier
scores the reply by the fraction of its characters that belong to the alphabet (whitespace and punctuation count
as characters outside it; an empty reply scores 0). The reward is dense, so even a random-init model gets a
gradient from its first rollouts: the tiny test model starts near 0.22 and SAO lifts it well above 0.5 within a
few hundred rollouts on CPU (see the package README for measured curves).

Tasks are generated in code from a seed (no data download) and vary in wording, so the prompt stream looks like a
real one while the verifier stays exact.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator

VOWELS = "aeiou"

#: The reply budget the task's requests set (``max_tokens``): its replies need a few words, and every token is
#: generated and then trained three times (2 critic steps + the actor), so learning stays fast while the
#: deployment's own default (``engine.max_new_tokens`` 256 under ``+recipe=sao``) lets ordinary answers finish.
MAX_TOKENS = 24

_TEMPLATES = (
    "Task {n}: reply using only the letters {letters}.",
    "Task {n}: write a word made only of {letters}.",
    "Exercise {n}. Use nothing but the letters {letters} in your answer.",
    "Say something with the letters {letters} and no others (#{n}).",
    "Question {n}: answer with letters from {letters} only.",
    "Write a short reply; allowed letters: {letters}. Ticket {n}.",
)


@dataclass(frozen=True)
class Task:
    """One task: an id, the user prompt and the alphabet the verifier accepts."""

    task_id: str
    prompt: str
    alphabet: str = VOWELS

    def messages(self) -> list[dict]:
        """The chat to send (one user turn)."""
        return [{"role": "user", "content": self.prompt}]


def task_stream(count: int | None = None, *, seed: int = 0, alphabet: str = VOWELS) -> Iterator[Task]:
    """Yield ``count`` tasks (endless with ``None``), deterministic for ``seed``."""
    if not alphabet:
        raise ValueError("alphabet must not be empty")
    rng = random.Random(seed)
    letters = ", ".join(alphabet)
    i = 0
    while count is None or i < count:
        n = rng.randint(1, 999)
        prompt = rng.choice(_TEMPLATES).format(letters=letters, n=n)
        yield Task(task_id=f"{seed}-{i}", prompt=prompt, alphabet=alphabet)
        i += 1


def score(task: Task, text: str) -> float:
    """The verifier: fraction of the characters of ``text`` in ``task.alphabet`` (0.0 for an empty reply)."""
    if not text:
        return 0.0
    allowed = set(task.alphabet)
    return sum(ch in allowed for ch in text) / len(text)


def verify(output: str, task: dict) -> float:
    """:func:`score` as a task-file verifier (``learn.verifier=python``, ``path: reef_sao.tasks:verify``): the task
    is a line of ``reef_sao/data/vowels.jsonl`` (its ``alphabet`` field)."""
    return score(Task(task_id=str(task.get("id", "")), prompt="", alphabet=task.get("alphabet") or VOWELS), output)


__all__ = ["VOWELS", "Task", "task_stream", "score", "verify"]
