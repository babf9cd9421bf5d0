"""Tasks and episodes: what GEPA evaluates a candidate on.

A *task* is a JSON dict: ``id`` (optional but recommended), the input as ``messages`` (chat turns) or
``input`` / ``question`` / ``prompt`` (one user message), plus whatever the verifier reads
(``answer``, ``category``...). Task sets come from config as a list, a dotted path to a list or to a
generator function, or ``{path, kwargs}``.

An :class:`Episode` is one GEPA data instance: a task, the client messages to run it with (the
harness text goes in front, as the surface injects it), and, for recorded traffic, the output the
served release gave with its reported score and feedback. The traffic result is reused when the
candidate being evaluated is exactly the harness text that produced it: that evaluation is free.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reef_core.api import SEPARATOR, ConfigError, Sample, ValidationFailed, content_text, load_object

Verifier = Callable[[str, dict], Any]
Feedback = Callable[[dict, str, float], str]

_INPUT_KEYS = ("input", "question", "prompt")


def load_tasks(spec: Any, what: str) -> list[dict]:
    """A task list from config: a list, ``"pkg.mod:name"`` (a list or a function returning one), or
    ``{path, kwargs}`` (a function called with ``kwargs``)."""
    kwargs: dict = {}
    if isinstance(spec, Mapping) and "path" in spec:
        kwargs = dict(spec.get("kwargs") or {})
        spec = spec["path"]
    if isinstance(spec, str):
        obj = load_object(spec)
        spec = obj(**kwargs) if callable(obj) else obj
    if not isinstance(spec, Sequence) or isinstance(spec, (str, bytes)):
        raise ConfigError(f"gepa {what}: expected a list of task dicts, got {type(spec).__name__}")
    tasks = [dict(t) for t in spec]
    if not tasks:
        raise ConfigError(f"gepa {what}: the task list is empty")
    keys = [task_key(t) for t in tasks]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"gepa {what}: task ids must be unique")
    return tasks


def load_callable(spec: Any, what: str) -> Callable | None:
    if spec is None:
        return None
    func = load_object(spec) if isinstance(spec, str) else spec
    if not callable(func):
        raise ConfigError(f"gepa {what}: {spec!r} is not callable")
    return func


def task_key(task: Mapping) -> str:
    """A stable key of a task: its ``id``, else a digest of its content."""
    if "id" in task and task["id"] is not None:
        return str(task["id"])
    return "sha256:" + hashlib.sha256(json.dumps(task, sort_keys=True, default=str).encode()).hexdigest()[:16]


def task_messages(task: Mapping) -> list[dict]:
    """The client messages of a task (never a harness system prompt)."""
    messages = task.get("messages")
    if isinstance(messages, list) and messages:
        return [dict(m) for m in messages]
    for key in _INPUT_KEYS:
        if key in task:
            return [{"role": "user", "content": str(task[key])}]
    raise ValidationFailed(f"task {task_key(task)} has no messages or input")


def input_text(messages: Sequence[Mapping]) -> str:
    """What reflection sees as a task's input: the one user message, or the turns as ``role: text``."""
    if len(messages) == 1 and messages[0].get("role") == "user":
        return content_text(messages[0].get("content"))
    return "\n\n".join(f"{m.get('role')}: {content_text(m.get('content'))}" for m in messages)


def strip_harness(messages: Sequence[Mapping], harness: str) -> list[dict] | None:
    """``messages`` without the harness text in front of the system prompt, or None when the system
    prompt does not start with it (the messages were shaped by some other text)."""
    out = [dict(m) for m in messages]
    if not harness:
        return out
    if not out or out[0].get("role") not in ("system", "developer"):
        return None
    text = content_text(out[0].get("content"))
    if not text.startswith(harness):
        return None
    rest = text[len(harness):]
    rest = rest[len(SEPARATOR):] if rest.startswith(SEPARATOR) else rest
    if rest:
        out[0]["content"] = rest
        return out
    return out[1:]


def default_feedback(task: dict, output: str, score: float) -> str:
    """GEPA's score-restating feedback: it carries no reason, so configure a real one."""
    return f"This response scored {score:.3f}. A better response would score higher."


def as_score(value: Any) -> float:
    """A verifier's verdict as GEPA's float (a failed or NaN episode scores 0)."""
    if value is None:
        return 0.0
    value = float(value)
    return 0.0 if math.isnan(value) else value


def feedback_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        for key in ("text", "feedback", "message"):
            if isinstance(value.get(key), str):
                return value[key]
    return json.dumps(value, sort_keys=True, default=str)


@dataclass(frozen=True)
class Traffic:
    """A recorded answer of the served release: the harness text that shaped it, output, score, feedback."""

    harness: str
    output: str
    score: float
    feedback: str | None


@dataclass(frozen=True)
class Episode:
    """One GEPA data instance (see the module docstring)."""

    key: str
    task: dict
    messages: list[dict]
    traffic: Traffic | None = None

    @property
    def input(self) -> str:
        return input_text(self.messages)

    def with_traffic(self, traffic: Traffic | None) -> "Episode":
        return Episode(self.key, self.task, self.messages, traffic)


def task_episode(task: dict) -> Episode:
    return Episode(task_key(task), task, task_messages(task))


def sample_episode(sample: Sample, served_harness: str) -> Episode | None:
    """The episode of a recorded sample (traffic), or None when it has no usable prompt."""
    if sample.reward is None or not sample.segments:
        return None
    raw = sample.prompt
    client = strip_harness(raw, served_harness)
    shaped_by = served_harness if client is not None else None
    if client is None:
        client = [dict(m) for m in raw]
    if not any(m.get("role") == "user" for m in client):
        return None
    meta_task = sample.metadata.get("task") if isinstance(sample.metadata, Mapping) else None
    if isinstance(meta_task, Mapping):
        task = dict(meta_task)
    else:
        task = {"id": str(meta_task) if meta_task is not None else (sample.report_id or sample.references[-1])}
    if "messages" not in task and not any(k in task for k in _INPUT_KEYS):
        task["messages"] = client
    traffic = None
    if shaped_by is not None:
        traffic = Traffic(shaped_by, sample.completion, as_score(sample.reward), feedback_text(sample.feedback))
    return Episode(task_key(task), task, client, traffic)
