"""The deterministic hash task of GEPA's differential oracle (recipes §7.5, §12.3).

45 training and 45 validation tasks (``"train problem i"``, ``"validation problem i"``); a
harness text's answer to a task is the token ``sha256(f"{text}|{task}")[:8]``, right iff
``int(token, 16) % 5 < 2`` (about two in five); feedback ``"correct"`` or ``"wrong for {task}"``;
the reflection model answers ``rules v<sha256(prompt)[:10]>`` in a fence. Nothing is learnable,
which is the point: every draw (parent, minibatch, acceptance) is decided by the algorithm alone,
so two implementations agree only if they make the same draws.
"""

from __future__ import annotations

import hashlib

SEED_TEXT = "Answer the question."


def train_tasks(n: int = 45) -> list[dict]:
    return [{"id": f"train-{i}", "input": f"train problem {i}"} for i in range(n)]


def val_tasks(n: int = 45) -> list[dict]:
    return [{"id": f"val-{i}", "input": f"validation problem {i}"} for i in range(n)]


def answer(text: str, task_input: str) -> str:
    return hashlib.sha256(f"{text}|{task_input}".encode()).hexdigest()[:8]


def score_of(output: str) -> float:
    token = output.strip()[-8:]
    try:
        return 1.0 if int(token, 16) % 5 < 2 else 0.0
    except ValueError:
        return 0.0


def task_model(messages: list[dict]) -> str:
    """Chat model: the answer token of (system prompt, last user message)."""
    system = next((m["content"] for m in messages if m.get("role") == "system"), "")
    user = [m["content"] for m in messages if m.get("role") == "user"][-1]
    return answer(system, user)


def verify(output: str, task: dict) -> float:
    return score_of(output)


def feedback(task: dict, output: str, score: float) -> str:
    return "correct" if score >= 1.0 else f"wrong for {task['input']}"


def reflect(prompt: str) -> str:
    """GEPA reflection LM (``prompt -> text``): a deterministic rewrite of what it was shown."""
    return f"```\nrules v{hashlib.sha256(prompt.encode()).hexdigest()[:10]}\n```"


def reflector(messages: list[dict]) -> str:
    """The same reflection model as a chat model (Reef's model interface)."""
    return reflect(messages[-1]["content"])
