"""Task files for offline learning runs: JSONL prompts and the verifier that scores a reply.

One task per line, a JSON object with the chat to send, either ``"messages": [{"role": ..., "content": ...}]``
or ``"prompt": "text"`` (one user turn), plus whatever fields its verifier reads (``expected`` for
``exact_match``, ``pattern`` for ``regex``, anything for a ``python`` verifier). Verifiers are the
evaluation gate's scorers (:data:`reef_core.commit.evaluators.SCORERS`), so a task file can also serve
as a gate's evaluation tasks.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import ConfigError

PKG_PREFIX = "pkg://"


def resolve_task_file(spec: str, key: str = "learn.file") -> Path:
    """The file ``spec`` names: a path, or ``pkg://<package>/<path>`` inside an installed package.

    ``key`` is the config key that names it, for error messages."""
    if spec.startswith(PKG_PREFIX):
        package, _, inner = spec[len(PKG_PREFIX):].partition("/")
        if not package or not inner:
            raise ConfigError(f"{key} {spec!r} must read pkg://<package>/<path>")
        try:
            root = resources.files(package)
        except ModuleNotFoundError:
            raise ConfigError(f"{key} {spec!r}: no installed package {package!r}") from None
        path = Path(str(root.joinpath(inner)))
    else:
        path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(f"{key} {spec!r} is not a file")
    return path


def load_tasks(spec: str | None, key: str = "learn.file") -> list[dict]:
    """Parse a task file; every task gets ``messages``. A malformed line fails naming its number (and ``key``,
    the config key naming the file: ``learn.file``, ``evaluation.tasks``)."""
    if not spec:
        raise ConfigError(f"{key} is not set: name a JSONL task file " + '(one {"messages": [...]} per line)')
    path = resolve_task_file(spec, key)
    tasks = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{key}: {path.name} line {number}"
        try:
            task = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{where}: not JSON ({exc})") from None
        if not isinstance(task, dict):
            raise ConfigError(f"{where}: a task must be a JSON object")
        tasks.append({**task, "messages": _messages(task, where)})
    if not tasks:
        raise ConfigError(f"{key} {spec!r} holds no task")
    return tasks


def _messages(task: dict, where: str) -> list[dict]:
    if "messages" in task:
        messages = task["messages"]
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages)):
            raise ConfigError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        return messages
    prompt = task.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ConfigError(f"{where}: a task needs 'messages' or a non-empty 'prompt'")
    return [{"role": "user", "content": prompt}]


def make_verifier(name: str, options: dict[str, Any]):
    """``score(reply_text, task) -> float | None`` from the gate's scorer ``name``."""
    from ..commit.evaluators import SCORERS

    if name not in SCORERS:
        raise ConfigError(f"learn.verifier must be one of {', '.join(sorted(SCORERS))}, not {name!r}")
    try:
        return SCORERS[name](**dict(options))
    except TypeError as exc:
        raise ConfigError(f"learn.verifier_options do not fit verifier {name!r}: {exc}") from None
