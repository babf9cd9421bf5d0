"""The example task stream and its verifier: "answer using only vowels".

Every task asks for a reply written with the letters of an alphabet (default: the vowels ``aeiou``). The
verifier (:func:`score`) multiplies two shares, each in [0, 1]:

* the *letter share*: the fraction of the reply's non-blank characters that belong to the alphabet, in either
  case (blanks are free, so "a e i o u" and "oui, eau" are fine; digits and punctuation count against);
* the *variety*: the fraction of the reply's character pairs (bigrams, lowercased) that are distinct, 1.0 for a
  reply shorter than three characters.

Variety is what makes the optimum honest. With the letter share alone (:func:`letter_share`, the verifier of
earlier rounds, which also counted blanks against), a policy gains by repeating one vowel-rich token until the
budget ends (" release release ...", "ionionion..."): the result packet ``results/2026-12-03-sao-tiny`` shows it.
Repetition repeats bigrams, so it now scores low; since five vowels and a blank make only 36 distinct pairs, a
long reply must repeat and the best replies are short vowel words that stop ("aeiou", "a e i o u", "oui").
The reward stays dense: a random-init model's first replies score about 0.2.

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


def letter_share(task: Task, text: str) -> float:
    """Fraction of the characters of ``text`` in ``task.alphabet``, blanks counted against (0.0 for an empty reply).

    The dense signal of earlier rounds, kept for tests of the loop's plumbing (any learnable reward will do
    there). A policy games it by repetition: use :func:`score` for anything about what is learned."""
    if not text:
        return 0.0
    allowed = set(task.alphabet)
    return sum(ch in allowed for ch in text) / len(text)


def variety(text: str) -> float:
    """Fraction of the character bigrams of ``text`` (lowercased) that are distinct; 1.0 below three characters."""
    text = text.lower()
    pairs = [text[i:i + 2] for i in range(len(text) - 1)]
    if len(pairs) < 2:
        return 1.0
    return len(set(pairs)) / len(pairs)


def score(task: Task, text: str) -> float:
    """The verifier: letter share of the non-blank characters times :func:`variety` (0.0 without any)."""
    marks = [ch for ch in text if not ch.isspace()]
    if not marks:
        return 0.0
    allowed = set(task.alphabet.lower())
    share = sum(ch.lower() in allowed for ch in marks) / len(marks)
    return share * variety(text.strip())


def _file_task(task: dict) -> Task:
    """A line of a task file (``reef_sao/data/vowels.jsonl``: its ``alphabet`` field) as a :class:`Task`."""
    return Task(task_id=str(task.get("id", "")), prompt="", alphabet=task.get("alphabet") or VOWELS)


def verify(output: str, task: dict) -> float:
    """:func:`score` as a task-file verifier (``learn.verifier=python``, ``path: reef_sao.tasks:verify``)."""
    return score(_file_task(task), output)


def verify_letter_share(output: str, task: dict) -> float:
    """:func:`letter_share` as a task-file verifier, for gate tests whose steered candidates repeat two letters."""
    return letter_share(_file_task(task), output)


__all__ = ["VOWELS", "Task", "task_stream", "score", "letter_share", "variety", "verify", "verify_letter_share"]
