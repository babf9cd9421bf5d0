"""A learnable GEPA task with a verifier, generated in code, and deterministic stand-in models.

Each task asks for the code of an item in one of four categories. The rule-based task model
(:func:`task_model`) answers a category-``c`` question correctly only if its system prompt contains
the fact ``FACTS[c]``; :func:`feedback` names the missing fact; the reflector (:func:`reflector`)
keeps the instruction it was shown and adds the first fact the feedback mentions that the instruction
lacks. A prompt therefore improves one category per accepted round: 0 -> 0.25 -> 0.5 -> 0.75 -> 1.0
on the validation tasks, one release at a time.

Recipe options (``conf/recipe/gepa.yaml`` uses them as defaults)::

    valset:    {path: reef_gepa.examples:tasks, kwargs: {split: val}}
    verifier:  reef_gepa.examples:verify
    feedback:  reef_gepa.examples:feedback
    reflection_model: reef_gepa.examples:reflector     # or served behind a stand-in server

Run ``python plugins/reef-gepa/examples/learning_demo.py`` for the whole loop through Reef.
"""

from __future__ import annotations

import random
import re

CATEGORIES = ("alpha", "beta", "gamma", "delta")
CODES = {"alpha": "ALP", "beta": "BET", "gamma": "GAM", "delta": "DEL"}
#: The fact a prompt needs for each category.
FACTS = {c: f"Fact {c}: the code of {c} item N is {CODES[c]}-N." for c in CATEGORIES}
SEED_PROMPT = "Answer with the code of the item."

_QUESTION = re.compile(r"\[(\w+)\][^\d]*(\d+)")


def tasks(split: str = "train", per_category: int = 6, seed: int = 0) -> list[dict]:
    """``per_category`` tasks per category, shuffled deterministically; val items never repeat train items."""
    offset = 0 if split == "train" else 1000
    out = []
    for c in CATEGORIES:
        for i in range(per_category):
            n = offset + 7 * i + CATEGORIES.index(c)
            out.append({"id": f"{split}-{c}-{n}", "category": c, "input": f"[{c}] What is the code of item {n}?",
                        "answer": f"{CODES[c]}-{n}"})
    random.Random(f"{seed}:{split}").shuffle(out)
    return out


def train_tasks() -> list[dict]:
    return tasks("train")


def val_tasks() -> list[dict]:
    return tasks("val")


def _system(messages: list[dict]) -> str:
    parts = []
    for m in messages:
        if m.get("role") in ("system", "developer"):
            content = m.get("content")
            parts.append(content if isinstance(content, str) else
                         "".join(p.get("text", "") for p in content or () if isinstance(p, dict)))
    return "\n".join(parts)


def task_model(messages: list[dict]) -> str:
    """Rule-based chat model: right on a category-c question iff the system prompt states FACTS[c]."""
    user = [m for m in messages if m.get("role") == "user"]
    text = user[-1].get("content") if user else ""
    text = text if isinstance(text, str) else "".join(p.get("text", "") for p in text if isinstance(p, dict))
    match = _QUESTION.search(text)
    if match is None or match.group(1) not in FACTS:
        return "I cannot tell what is asked."
    category, number = match.group(1), match.group(2)
    if FACTS[category] in _system(messages):
        return f"{CODES[category]}-{number}"
    return f"I do not know the code of item {number}."


def verify(output: str, task: dict) -> float:
    """1.0 for exactly the expected code."""
    return 1.0 if str(output).strip() == task["answer"] else 0.0


_CODE = re.compile(r"\b(ALP|BET|GAM|DEL)-(\d+)\b")


def verify_mentions(output: str, task: dict) -> float:
    """1.0 when the answer names the expected code and no other item code: the verifier for a real chat model,
    which wraps its answer in a sentence ("The code is ALP-7.") where the stand-in answers the bare code."""
    codes = {f"{m.group(1)}-{m.group(2)}" for m in _CODE.finditer(str(output))}
    return 1.0 if codes == {task["answer"]} else 0.0


def feedback(task: dict, output: str, score: float) -> str:
    """Names the fact a wrong answer lacked: the only signal reflection gets."""
    if score >= 1.0:
        return "Correct."
    return f"Incorrect. The assistant needs this fact: {FACTS[task['category']]}"


def reflector(messages: list[dict]) -> str:
    """Deterministic reflection model: the current instruction plus the first fact the feedback mentions
    that it lacks (the instruction unchanged when there is none)."""
    prompt = messages[-1]["content"]
    start = prompt.find("```\n") + 4
    end = prompt.find("\n```", start)
    current = prompt[start:end] if start >= 4 and end >= 0 else ""
    shown = prompt[end:] if end >= 0 else prompt
    found = sorted((shown.find(fact), fact) for fact in FACTS.values() if fact in shown and fact not in current)
    new = "\n".join([current.rstrip(), *(fact for _, fact in found[:1])]).strip()
    return f"```\n{new}\n```"


def score_prompt(system_prompt: str, task_list: list[dict]) -> float:
    """Mean score of ``system_prompt`` on ``task_list`` with the stand-in task model (for demos)."""
    results = [verify(task_model([{"role": "system", "content": system_prompt},
                                  {"role": "user", "content": t["input"]}]), t) for t in task_list]
    return sum(results) / len(results)


__all__ = ["CATEGORIES", "CODES", "FACTS", "SEED_PROMPT", "tasks", "train_tasks", "val_tasks", "task_model",
           "verify", "verify_mentions", "feedback", "reflector", "score_prompt"]
