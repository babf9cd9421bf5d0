"""The problem a TTT scenario works on, and the guidance and executor rules both sides share.

A *task* is any object built by a ``module:factory`` path (``recipe.options.task``, called with
``recipe.options.task_options``) with:

* ``seeds() -> list[state]``: the starting states (JSON values) the archive is seeded with;
* ``score(state) -> float | None``: the verifier; None for a state it refuses (a failed rollout: 0 reward, a visit,
  never an archive entry). The server re-scores every reported state with it, so the archive never trusts a claim;
* ``prompt(state, value, *, guidance: bool) -> list[chat messages]``: what the model sees for a parent;
* optional ``state_from_reply(text) -> state | None`` (discover mode; default: the reply text is the state);
* optional ``execute(parent_state, guidance, *, seed) -> state`` (guidance mode's default executor).

Clients load the same task from the plan (``task`` and ``task_options`` fields), so both sides score alike.

Guidance mode: a guide reply must contain exactly one non-empty ``<guidance>...</guidance>`` block (with
``guidance_tags`` off, any non-empty reply is the guidance). Malformed guidance scores 0, skips the executor and
still counts a visit; the server enforces the 0 whatever a client reports.
"""

from __future__ import annotations

import json
import re
import urllib.request
from typing import Any, Callable

from reef_core.api import ConfigError, load_callable

_GUIDANCE = re.compile(r"<guidance>(.*?)</guidance>", re.DOTALL)


def load_task(path: str, options: dict | None = None) -> Any:
    """Build the task a ``module:factory`` path names (a ConfigError naming ``recipe.options.task`` if not)."""
    try:
        factory = load_callable(path, "recipe.options.task")
    except Exception as exc:  # noqa: BLE001 - any import problem is a config problem here
        raise ConfigError(f"ttt: recipe.options.task {path!r} cannot be loaded: {exc}") from None
    try:
        task = factory(**(options or {}))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"ttt: recipe.options.task_options do not fit {path!r}: {exc}") from None
    for name in ("seeds", "score", "prompt"):
        if not callable(getattr(task, name, None)):
            raise ConfigError(f"ttt: the task {path!r} has no {name}() method")
    return task


def parse_guidance(text: str | None, *, tags: bool = True) -> str | None:
    """The guidance of a guide reply, or None when it is malformed (see the module docstring)."""
    if text is None:
        return None
    if not tags:
        return text.strip() or None
    blocks = _GUIDANCE.findall(text)
    if len(blocks) != 1 or text.count("<guidance>") != 1 or not blocks[0].strip():
        return None
    return blocks[0].strip()


def state_from_reply(task: Any, text: str) -> Any:
    """The state a discover-mode reply proposes (the task's parser, else the text itself)."""
    parse = getattr(task, "state_from_reply", None)
    return parse(text) if callable(parse) else text


def load_executor(spec: str | None, task: Any) -> Callable[..., Any]:
    """``executor(parent_state, guidance, *, seed) -> state``: a ``module:function`` path, an OpenAI-compatible base
    URL (``http(s)://...``, asked for a ``<solution>`` holding the new state as JSON), or the task's ``execute``."""
    if spec is None:
        execute = getattr(task, "execute", None)
        if not callable(execute):
            raise ConfigError("ttt: guidance mode needs recipe.options.executor or a task with execute()")
        return execute
    if spec.startswith(("http://", "https://")):
        return HttpExecutor(spec, task)
    return load_callable(spec, "recipe.options.executor")


class HttpExecutor:
    """A frozen executor behind an OpenAI-compatible ``/chat/completions`` endpoint. Its tokens never train: it is
    called by the client, outside the scenario."""

    def __init__(self, base_url: str, task: Any, model: str = "executor", timeout: float = 120.0):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.task = task
        self.model = model
        self.timeout = timeout

    def __call__(self, parent: Any, guidance: str, *, seed: int | None = None) -> Any:
        content = (f"Parent state:\n{json.dumps(parent)}\n\nGuidance:\n{guidance}\n\n"
                   "Apply the guidance and reply with the new state as JSON inside <solution>...</solution>.")
        body = {"model": self.model, "messages": [{"role": "user", "content": content}]}
        if seed is not None:
            body["seed"] = seed
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            reply = json.loads(response.read())["choices"][0]["message"]["content"] or ""
        found = re.search(r"<solution>(.*?)</solution>", reply, re.DOTALL)
        if not found:
            return None
        try:
            return json.loads(found.group(1))
        except ValueError:
            return found.group(1).strip()
