"""Counting a prompt's tokens for an OpenAI-dialect provider, which has no counting route.

``POST /v1/messages/count_tokens`` through ``engine.kind=upstream`` with ``engine.upstream_dialect=openai`` is answered
here, best way first; the answer's ``x-reef-token-count`` header names the way used:

* ``tokenizer`` (``engine.upstream_tokenizer``: a model directory holding the provider's model's tokenizer and chat
  template): the prompt rendered and tokenized as a server of that model renders it, tools included. Exact for a
  self-hosted server (vLLM, SGLang, Reef) of that model;
* ``tiktoken``: a model name tiktoken knows (``gpt-4o``, ``gpt-4``, ``o1``, ...) with its encoding loadable (from
  tiktoken's cache, ``TIKTOKEN_CACHE_DIR``, or a download): the messages framed the way OpenAI's published counting
  recipe frames them (3 tokens per message, 1 more for a ``name``, 3 priming the reply). Tool definitions are counted
  as their JSON text: OpenAI publishes no exact rule for them, so with tools this is close, not exact;
* ``estimate``: a quarter of the prompt's characters (:func:`~reef_core.engines.upstream.estimate_tokens`).

A prompt with non-text parts (images) is estimated: neither tokenizer sees them as the provider does.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any, Callable

from reef_core.content import content_text
from reef_core.errors import ConfigError

log = logging.getLogger("reef.engines.token_count")

#: OpenAI's recipe: tokens framing each message, a message's ``name``, and the reply's priming.
PER_MESSAGE, PER_NAME, REPLY_PRIMING = 3, 1, 3


class PromptCounter:
    """Counts prompts of an OpenAI-dialect chat body; :meth:`count` returns ``(tokens, way)`` or None (estimate)."""

    def __init__(self, tokenizer_dir: str | Path | None = None):
        self._tok = _load_tokenizer(Path(tokenizer_dir)) if tokenizer_dir else None
        self._encodings: dict[str, Any] = {}  # encoding name -> tiktoken Encoding, or None when it cannot load
        self._lock = threading.Lock()

    def count(self, body: dict, model: str | None) -> tuple[int, str] | None:
        """Blocking (it may load an encoding once): call it off the event loop."""
        messages = _text_messages(body)
        if messages is None:
            return None
        if self._tok is not None:
            kwargs = {"tools": body["tools"]} if body.get("tools") else {}
            text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
            return len(self._tok(text, add_special_tokens=False)["input_ids"]), "tokenizer"
        encode = self._tiktoken(model)
        if encode is None:
            return None
        n = REPLY_PRIMING
        for m in messages:
            n += PER_MESSAGE
            for key, value in m.items():
                if key == "tool_calls" and value:
                    n += len(encode(json.dumps(value)))
                elif isinstance(value, str):
                    n += len(encode(value)) + (PER_NAME if key == "name" else 0)
        if body.get("tools"):
            n += len(encode(json.dumps(body["tools"])))
        return n, "tiktoken"

    def _tiktoken(self, model: str | None) -> Callable[[str], list[int]] | None:
        if not model:
            return None
        try:
            import tiktoken
        except ImportError:
            return None
        try:
            name = tiktoken.encoding_name_for_model(model)
        except KeyError:
            return None
        with self._lock:
            if name not in self._encodings:
                try:
                    self._encodings[name] = tiktoken.get_encoding(name)
                except Exception as exc:  # no cached file and no network: estimate from now on, said once
                    log.warning("tiktoken cannot load the %s encoding (%s: %s): count_tokens estimates for %s; "
                                "put the file in TIKTOKEN_CACHE_DIR", name, type(exc).__name__, exc, model)
                    self._encodings[name] = None
        encoding = self._encodings[name]
        return None if encoding is None else (lambda text: encoding.encode(text, disallowed_special=()))


def _text_messages(body: dict) -> list[dict] | None:
    """The body's messages with text content (tool fields kept), or None when one carries a non-text part."""
    out = []
    for m in body.get("messages") or []:
        if not isinstance(m, dict):
            return None
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") != "text" for p in content):
            return None
        out.append({**m, "content": content_text(content, non_text="skip")})
    return out or None


def _load_tokenizer(directory: Path):
    from transformers import AutoTokenizer

    if not directory.is_dir():
        raise ConfigError(f"engine.upstream_tokenizer {directory} is not a directory", path=str(directory))
    try:
        tok = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"engine.upstream_tokenizer {directory} holds no tokenizer: {exc}",
                          path=str(directory)) from exc
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"engine.upstream_tokenizer {directory}: the tokenizer has no chat template to render "
                          "prompts with", path=str(directory))
    return tok
