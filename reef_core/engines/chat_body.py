"""What an engine that renders the prompt itself reads from an OpenAI chat body: messages and sampling knobs.

The embedded engine and the SGLang engine (which renders the chat template and samples through SGLang's native
route) read a client body the same way: :func:`chat_messages` and :func:`sampling_params` check it once, raising
:class:`~reef_core.errors.ValidationFailed` naming the parameter (a 400 in the client's dialect).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..content import content_text
from ..errors import ValidationFailed


@dataclass(frozen=True)
class SamplingParams:
    max_new: int
    temperature: float
    top_p: float
    stops: list[str]
    seed: int | None
    logprobs: bool
    top_logprobs: int
    include_usage: bool
    model: str


def number(body: dict, key: str, default, kind, lo=None, hi=None):
    """``body[key]`` as ``kind`` within ``[lo, hi]`` (None: ``default``); a bool or NaN is refused."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool):
        raise ValidationFailed(f"{key} must be a number", param=key)
    try:
        value = kind(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValidationFailed(f"{key} must be a number", param=key) from exc
    # Written so that NaN fails too.
    if not ((lo is None or value >= lo) and (hi is None or value <= hi)):
        raise ValidationFailed(f"{key} out of range [{lo}, {hi}]", param=key)
    return value


def sampling_params(body: dict, *, max_new_tokens: int, temperature: float, top_p: float, model: str,
                    one_choice: str) -> SamplingParams:
    """The sampling knobs of ``body`` over the engine's defaults; ``one_choice`` explains why ``n`` must be 1."""
    if (body.get("n") or 1) != 1:
        raise ValidationFailed(f"{one_choice} (n must be 1)", param="n")
    max_new = body.get("max_completion_tokens") or body.get("max_tokens")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else [] if stop is None else None
    if stops is None or not all(isinstance(s, str) for s in stops):
        raise ValidationFailed("stop must be a string or a list of strings", param="stop")
    seed = body.get("seed")
    # torch seeds are 64-bit; a larger one would fail inside generation, as if the engine had.
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**63):
        raise ValidationFailed("seed must be a 64-bit integer", param="seed")
    return SamplingParams(
        max_new=number({"max_tokens": max_new}, "max_tokens", max_new_tokens, int, 1, None),
        temperature=number(body, "temperature", temperature, float, 0.0, 2.0),
        top_p=number(body, "top_p", top_p, float, 0.0, 1.0),
        stops=stops,
        seed=seed,
        logprobs=bool(body.get("logprobs")),
        top_logprobs=number(body, "top_logprobs", 0, int, 0, 20),
        include_usage=bool((body.get("stream_options") or {}).get("include_usage")),
        model=body.get("model") or model,
    )


def chat_messages(body: dict, *, where: str) -> list[dict]:
    """``body["messages"]`` as ``{"role", "content": text}`` dicts (tool fields kept) for a chat template.

    The models read text only: any other content part is refused (``where`` names the engine in the message),
    never silently dropped."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ValidationFailed("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValidationFailed(f"messages[{i}] needs a role", param=f"messages[{i}].role")
        msg = {"role": m["role"], "content": content_text(m.get("content"), non_text="raise", where=where)}
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                msg[key] = m[key]
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = _template_calls(m["tool_calls"], f"messages[{i}].tool_calls")
        out.append(msg)
    return out


def _template_calls(calls, where: str) -> list[dict]:
    """An assistant turn's tool calls as chat templates read them: ``function.arguments`` an object, not the JSON
    text OpenAI sends (templates write it with ``tojson``; a string would be quoted twice). Arguments that are not JSON
    stay the text they are."""
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise ValidationFailed(f"{where} must be a list of tool call objects", param=where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValidationFailed(f"{where}[{j}].function needs a name", param=f"{where}[{j}].function")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # not JSON: the text as the model wrote it
        out.append({**call, "function": {**fn, "arguments": args if args is not None else {}}})
    return out
