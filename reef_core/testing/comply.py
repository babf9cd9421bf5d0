"""Run llm-comply (the external validator pinned in the test extra) against a live ``reef serve``.

llm-comply checks live endpoints against the providers' published specs (OpenAI Chat, Open Responses, Anthropic
Messages: the OpenAPI documents it bundles). The serve tests (every engine kind Reef runs here) and the real-engine
tests (the real vLLM) judge Reef's answers with the same runner and the same rules:

* a skip is allowed only for a feature the spec marks optional that Reef does not offer (:data:`OPTIONAL_SKIPS`);
* a failure is allowed only where the caller names it, with the error it must begin with
  (:data:`TINY_MODEL_LIMITS`: what a tiny text-only model cannot pass honestly); any other failure, a schema error
  above all, is unexpected.

llm-comply is imported when a suite runs, so this module imports without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: The version the test extra pins (``pyproject.toml``); the tests check the installed one against it.
LLM_COMPLY_VERSION = "0.5.0"
#: llm-comply's format names and the spec each is judged by (in its ``specs`` folder).
FORMATS = {"anthropic": "anthropic.json", "openai-chat": "openai_chat.json", "open-responses": "openresponses.json"}
#: Checks of features the specs mark optional that Reef does not offer (extended thinking, reasoning summaries).
OPTIONAL_SKIPS = frozenset({"anth-thinking-display", "chat-reasoning-summary", "reasoning-summary"})
#: A tiny text-only model (the fake tool-calling model) fails only these checks, and only with these errors: image
#: input is refused with a 400 in the dialect, and ``get_weather`` is a tool it was never taught (``tool_choice``
#: ``required`` is asked for, not enforced by constrained decoding).
TINY_MODEL_LIMITS = {
    "anth-image-input": "HTTP 400", "chat-image-input": "HTTP 400", "image-input": "HTTP 400",
    "anth-tool-calling": ("no content block with type='tool_use'", "stop_reason: expected 'tool_use'"),
    "chat-tool-calling": ("choices[0].message.tool_calls is missing", "finish_reason: expected 'tool_calls'"),
    "tool-calling": "no output item with type='function_call'",
}


def specs_dir() -> Path:
    import llm_comply

    return Path(llm_comply.__file__).parent / "specs"


@dataclass
class Outcome:
    """One format's suite: what failed that was not allowed, what was skipped, and the counts."""

    unexpected: dict[str, list[str]]
    skipped: set[str]
    passed: int
    total: int

    @property
    def summary(self) -> str:
        return f"{self.passed}/{self.total} passed, {len(self.skipped)} skipped, {len(self.unexpected)} unexpected"


def run_format(base_url: str, fmt: str, *, scenario: str, allowed: dict | None = None,
               timeout: float = 120) -> Outcome:
    """Run llm-comply's ``fmt`` suite against ``base_url`` (Reef's ``/v1``) in ``scenario``; ``allowed``: the
    failures to accept (test id to the error prefix, a tuple of them, or ``"HTTP 400"`` for a refusal)."""
    from llm_comply.config import ComplianceConfig
    from llm_comply.runner import TestRunner
    from llm_comply.schema import SpecLoader
    from llm_comply.tests import get_tests

    config = ComplianceConfig(base_url=base_url, api_key="unused", model="m", timeout=timeout,
                              extra_headers={"x-reef-scenario": scenario})
    suite = TestRunner(config, get_tests(fmt), SpecLoader(str(specs_dir() / FORMATS[fmt]))).run_all()
    allowed = allowed or {}
    failed = {r.id: r.errors for r in suite.results if r.status.value == "failed"}
    skipped = {r.id for r in suite.results if r.status.value == "skipped"}
    unexpected = {test: errors for test, errors in failed.items() if not _within(allowed.get(test), errors)}
    unexpected.update({test: ["skipped, and the feature is not optional"] for test in skipped - OPTIONAL_SKIPS})
    return Outcome(unexpected, skipped, suite.passed, len(suite.results))


def _within(limit, errors: list[str]) -> bool:
    if limit == "HTTP 400":  # the refusal; the errors after it are the checks of a success body run on it
        return bool(errors) and errors[0].startswith(limit)
    return limit is not None and all(e.startswith(limit) for e in errors)
