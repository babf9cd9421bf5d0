"""The plain text of a chat message's ``content``, the one flattener every part of Reef uses.

Content is a string, a list of parts (OpenAI and Anthropic typed parts, or bare strings), or one
part. Text parts (``type`` ``text``, ``input_text`` or ``output_text``) and bare strings give their
text, joined by ``separator``. What happens to anything else is the caller's rule, stated at the call:

* ``non_text="skip"``: images, audio, tool calls... contribute nothing (reading text for a reward or
  a prompt);
* ``non_text="raise"``: ValidationFailed naming ``where`` (translating between dialects, where dropping
  a part would change the request);
* ``tool_results=True``: an Anthropic ``tool_result`` part contributes the text of its own content.
"""

from __future__ import annotations

from typing import Any, Literal

from reef_core.errors import ValidationFailed

TEXT_PART_TYPES = ("text", "input_text", "output_text")


def content_text(content: Any, *, non_text: Literal["skip", "raise"] = "skip", separator: str = "",
                 tool_results: bool = False, where: str = "content") -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        content = [content]
    if not isinstance(content, list):
        if non_text == "raise":
            raise ValidationFailed(f"{where}: content must be a string or a list of parts")
        return ""
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(part, str):
            texts.append(part)
        elif kind in TEXT_PART_TYPES:
            texts.append(str(part.get("text") or ""))
        elif kind == "tool_result" and tool_results:
            texts.append(content_text(part.get("content"), non_text=non_text, separator=separator,
                                      tool_results=True, where=where))
        elif non_text == "raise":
            raise ValidationFailed(f"{where}: only text parts can be used here, not {kind or type(part).__name__!r}")
    return separator.join(texts)
