"""Parsing a request body as a JSON object, bounded in nesting depth.

Deeply nested input is refused before it reaches code that recurses over it (``json.loads``
itself raises ``RecursionError`` near 1,000 levels; canonical hashing, deep copies and dialect
translation recurse too). The check costs two ``bytes.count`` calls for ordinary bodies and a
walk without recursion otherwise. Non-standard constants (``NaN``, ``Infinity``) are refused:
they are not JSON, and no provider accepts them. So are lone surrogates (``"\\ud800"``, or their bytes): valid JSON
syntax naming no character, they cannot be encoded as UTF-8, so every later digest, store or answer would fail on
them. Checked once here, for every route that reads a body, with the field named.
"""

from __future__ import annotations

import json
import re

from reef_core.errors import ValidationFailed

#: Deepest nesting of arrays and objects a request body may have (the body object is level 1).
MAX_DEPTH = 64


def _refuse_constant(name: str):
    raise ValidationFailed(f"request body is not valid JSON ({name} is not a JSON value)")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)
#: A ``\\uD800``-``\\uDFFF`` escape in the text: the only way (besides raw surrogate bytes) JSON yields one.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def shown(text: str) -> str:
    """``text`` safe to quote in an answer or a log line: a lone surrogate as its ``\\udXXX`` escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def lone_surrogate_at(value) -> str | None:
    """The path (``messages[0].content``, a key as its escape) of the first string or key in ``value`` holding a
    lone surrogate, or None. Without recursion, like :func:`nesting_depth`."""
    stack = [(value, "")]
    while stack:
        node, path = stack.pop()
        if type(node) is dict:
            for key, child in node.items():
                where = f"{path}.{shown(key)}" if path else shown(key)
                if not _encodable(key):
                    return where
                stack.append((child, where))
        elif type(node) is list:
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(node))
        elif type(node) is str and not _encodable(node):
            return path or "body"
    return None


def nesting_depth(value, limit: int) -> int:
    """Depth of nested lists and dicts in ``value`` (a scalar is 0); counting stops past ``limit``."""
    if not isinstance(value, (dict, list)):
        return 0
    deepest = 1
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                break
        for child in node.values() if type(node) is dict else node:
            if type(child) is dict or type(child) is list:
                stack.append((child, depth + 1))
    return deepest


def parse_json_object(raw: bytes, max_depth: int = MAX_DEPTH) -> dict:
    """``raw`` as a JSON object, or :class:`ValidationFailed` saying why not."""
    try:
        # What json.loads does with bytes, with one decoder built once (loads builds one per call given options).
        encoding = json.detect_encoding(raw)
        text = raw.decode(encoding, "surrogatepass")
        body = _DECODER.decode(text)
    except RecursionError:
        raise ValidationFailed(f"request body is nested deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError):
        # ValueError covers integers beyond Python's digit limit as well as malformed JSON.
        raise ValidationFailed("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ValidationFailed("request body must be a JSON object")
    # Fewer brackets than the limit cannot nest deeper than it: skip the walk for ordinary bodies.
    if raw.count(b"[") + raw.count(b"{") > max_depth and nesting_depth(body, max_depth) > max_depth:
        raise ValidationFailed(f"request body is nested deeper than {max_depth} levels")
    # Ordinary bodies hold neither an escape nor raw surrogates (in UTF-8, a 0xED lead byte): skip the walk.
    escaped = "\\u" in text and _SURROGATE_ESCAPE.search(text) is not None
    if escaped or (b"\xed" in raw if encoding.startswith("utf-8") else not _encodable(text)):
        where = lone_surrogate_at(body)
        if where is not None:
            raise ValidationFailed(f"{where}: holds a lone surrogate (an unpaired \\ud800-\\udfff escape), "
                                   "which is not Unicode text", param=where)
    return body
