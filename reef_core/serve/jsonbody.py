"""Parsing a request body as a JSON object, bounded in nesting depth.

Deeply nested input is refused before it reaches code that recurses over it (``json.loads``
itself raises ``RecursionError`` near 1,000 levels; canonical hashing, deep copies and dialect
translation recurse too). The check costs two ``bytes.count`` calls for ordinary bodies and a
walk without recursion otherwise. Non-standard constants (``NaN``, ``Infinity``) are refused:
they are not JSON, and no provider accepts them.
"""

from __future__ import annotations

import json

from ..errors import ValidationFailed

#: Deepest nesting of arrays and objects a request body may have (the body object is level 1).
MAX_DEPTH = 64


def _refuse_constant(name: str):
    raise ValidationFailed(f"request body is not valid JSON ({name} is not a JSON value)")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


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
        body = _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
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
    return body
