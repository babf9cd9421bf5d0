"""The ``prm`` judge: a chat model votes on each (turn, next state) pair (OpenClaw-RL's process reward model).

Per pair it makes ``m`` *evaluative* calls and ``m`` *directive* calls, concurrently (at most ``concurrency``):

* evaluative: the model ends with ``\\boxed{1}`` (the reply helped), ``\\boxed{-1}`` (the next state asks for a
  change, a redo, a rephrasing, or reports a tool error) or ``\\boxed{0}`` (no telling). The last boxed value of each
  answer is its vote; the plurality of valid votes is the score, and a tie, no valid vote, a failed or timed-out call
  all count as 0 (:func:`~reef_openclaw.judges.plurality`).
* directive: the model says what the assistant should have known, as ``\\boxed{1}`` plus a hint between
  ``[HINT_START]`` and ``[HINT_END]``, or ``\\boxed{-1}`` when the next state carries no instruction. Hints of votes
  scoring 1 are candidates (:func:`~reef_openclaw.judges.select_hints`: longer than 10 characters, deduplicated,
  shortest first, at most ``max_hint_candidates``).

The chat model (``model``) is the deployment's served model (``null``), any OpenAI-compatible endpoint
(``{url, model, api_key_env}``) or a dotted callable ``fn(messages) -> str``; ``temperature`` and ``max_tokens`` are
sent with every call to an endpoint or the served model. The prompts are this package's own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from reef_core.api import ConfigError, option_values, resolve_chat_model

from reef_openclaw.judges import HINT_END, HINT_START, JudgeMeter, Verdict, extract_hint, parse_boxed, plurality, \
    select_hints

EVALUATIVE_SYSTEM = (
    "You grade one reply of an AI assistant by what happened right after it. You see the conversation up to the "
    "reply, the reply, and the next state: the user's next message or the result of a tool the assistant called.\n"
    "Decide whether the reply served the user:\n"
    "- good (1): the user moves on, thanks the assistant, builds on the reply, or the tool ran and returned what "
    "was needed;\n"
    "- bad (-1): the user corrects the assistant, asks for a change, a redo or a retry, repeats or rephrases the "
    "request, complains, or the tool call failed or returned an error;\n"
    "- unclear (0): the next state says nothing either way.\n"
    "Think briefly, then end your answer with exactly one of \\boxed{1}, \\boxed{-1} or \\boxed{0}."
)

DIRECTIVE_SYSTEM = (
    "You read one reply of an AI assistant and what happened right after it (the user's next message or a tool "
    "result). If the next state tells what the assistant should have done differently (a correction, a preference, "
    "a missing detail, an error to avoid), write that lesson as an instruction the assistant could have been given "
    "BEFORE replying: one to three concrete sentences addressed to the assistant, without quoting the reply.\n"
    f"Answer \\boxed{{1}} followed by the instruction between {HINT_START} and {HINT_END}, for example:\n"
    f"\\boxed{{1}} {HINT_START}Answer in one short sentence and put the number first.{HINT_END}\n"
    "If the next state teaches nothing about the reply, answer \\boxed{-1} and nothing else."
)


def _transcript(turn: dict) -> str:
    lines = []
    for message in turn.get("messages") or []:
        content = message.get("content")
        text = content if isinstance(content, str) else str(content or "")
        lines.append(f"[{message.get('role', '?')}] {text}")
    return "\n".join(lines)


def evaluative_messages(turn: dict, next_state: dict) -> list[dict]:
    """The chat messages of one evaluative vote."""
    user = (f"Conversation so far:\n{_transcript(turn)}\n\nAssistant reply being graded:\n{turn.get('reply', '')}\n\n"
            f"Next state ({next_state.get('role', 'user')}):\n{next_state.get('content', '')}")
    return [{"role": "system", "content": EVALUATIVE_SYSTEM}, {"role": "user", "content": user}]


def directive_messages(turn: dict, next_state: dict) -> list[dict]:
    """The chat messages of one directive (hint) vote."""
    user = (f"Conversation so far:\n{_transcript(turn)}\n\nAssistant reply:\n{turn.get('reply', '')}\n\n"
            f"Next state ({next_state.get('role', 'user')}):\n{next_state.get('content', '')}")
    return [{"role": "system", "content": DIRECTIVE_SYSTEM}, {"role": "user", "content": user}]


@dataclass(frozen=True)
class PRMOptions:
    """Knobs of the ``prm`` judge (``recipe.processor_options.judges.prm``), with OpenClaw-RL's defaults."""

    #: null: the served model; ``{url, model, api_key_env}``: an OpenAI-compatible endpoint; ``"pkg.mod:fn"``.
    model: Any = None
    #: Votes per pair, for each of the evaluative and the directive judge.
    m: int = 3
    temperature: float = 0.6
    max_tokens: int = 8192
    #: A call slower than this is a failed vote (endpoints only; the served model has the engine's own timeout).
    timeout_s: float = 120.0
    #: Calls in flight per pair.
    concurrency: int = 8
    max_hint_candidates: int = 3

    @classmethod
    def parse(cls, options: Any) -> "PRMOptions":
        opts = cls(**option_values(cls, options, who="judge 'prm'", section="processor_options.judges.prm"))
        for name in ("m", "max_tokens", "concurrency", "max_hint_candidates"):
            value = getattr(opts, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"judge 'prm': judges.prm.{name} must be a positive integer, got {value!r}")
        for name, floor in (("temperature", "non-negative"), ("timeout_s", "positive")):
            value = getattr(opts, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (floor == "positive" and value == 0):
                raise ConfigError(f"judge 'prm': judges.prm.{name} must be a {floor} number, got {value!r}")
        return opts

    def chat_spec(self) -> Any:
        """The model spec for :func:`reef_core.api.resolve_chat_model`, with the sampling settings filled in."""
        request = {"temperature": float(self.temperature), "max_tokens": int(self.max_tokens)}
        if self.model is None or self.model == "served":
            return {"kind": "served", "request": request}
        if isinstance(self.model, Mapping):
            spec = dict(self.model)
            spec["request"] = {**request, **dict(spec.get("request") or {})}
            spec.setdefault("timeout_s", float(self.timeout_s))
            return spec
        return self.model


class PRMJudge:
    """Votes of a chat model (see the module docstring); ``chat(messages) -> str``."""

    def __init__(self, chat, options: PRMOptions | None = None):
        self.chat = chat
        self.options = options or PRMOptions()
        self.meter = JudgeMeter()
        self._pool = ThreadPoolExecutor(max_workers=self.options.concurrency, thread_name_prefix="reef-prm")

    def _ask(self, messages: list[dict]) -> str | None:
        started = time.monotonic()
        try:
            text = self.chat(messages)
            ok = isinstance(text, str)
        except Exception:  # noqa: BLE001 - a failed call is a failed vote
            text, ok = None, False
        self.meter.add(calls=1, seconds=time.monotonic() - started)
        return text if ok else None

    def __call__(self, *, turn: dict, next_state: dict) -> Verdict:
        m = self.options.m
        asks = [evaluative_messages(turn, next_state)] * m + [directive_messages(turn, next_state)] * m
        answers = list(self._pool.map(self._ask, asks))
        evaluative, directive = answers[:m], answers[m:]
        votes = [parse_boxed(a) for a in evaluative]
        hints = [extract_hint(a) for a in directive if parse_boxed(a) == 1]
        self.meter.add(failed=sum(v is None for v in votes) + sum(parse_boxed(a) is None for a in directive))
        verdict = {"score": float(plurality(votes)), "hints": select_hints(hints, self.options.max_hint_candidates)}
        if all(v is None for v in votes) and all(parse_boxed(a) is None for a in directive):
            verdict["failed"] = True  # no call gave a valid vote: a broken judge, not a neutral turn
        return verdict

    def status(self) -> dict:
        return {"kind": "prm", "m": self.options.m, **self.meter.status()}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def make_prm_judge(*, options: Any = None, engine: Any = None, run_async: Any = None, **_context) -> PRMJudge:
    """``prm`` judge factory (registered through ``reef_register_judges``)."""
    opts = PRMOptions.parse(options)
    chat = resolve_chat_model(opts.chat_spec(), engine=engine, run_async=run_async,
                              what="processor_options.judges.prm.model")
    return PRMJudge(chat, opts)
