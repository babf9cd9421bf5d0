"""Task-file verifiers for tests (``learn.verifier=python``, ``learn.verifier_options.path=...``)."""

from __future__ import annotations

import hashlib


def reply_digest(output: str, task: dict) -> float:
    """A score in [0, 1) read off the sha256 of the reply: any change of reply changes it, so a test can tell
    apart weights that answer differently (path ``reef_core.testing.verifiers:reply_digest``)."""
    return int.from_bytes(hashlib.sha256(output.encode("utf-8", "surrogatepass")).digest()[:6], "big") / 2.0 ** 48
