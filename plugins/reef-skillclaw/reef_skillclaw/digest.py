"""Session digests: what the night learns from, rebuilt from the proxy's own records.

A graded session arrives as one sample (its report quoting every receipt of the session, merged by Reef into one
trajectory of normalised OpenAI-style turns). :func:`build_digest` turns it into a :class:`SessionDigest`: the
task and category the report named, its score (``None`` for the unscored sentinel), the number of turns, every
tool call matched to its result (and whether that result was an error), the skills the session read (calls of a
skill tool naming a slug) and the skills its catalog offered (parsed from the injected catalog), plus a compact
programmatic trajectory. :meth:`SessionDigest.render` is the text the evolver's prompts quote.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from reef_core.api import CATALOG_OPEN, Sample

_ERROR = re.compile(r"^\s*(?:error|exception|traceback|failed|failure)\b", re.I)
_CATALOG_LINE = re.compile(r"^- ([a-z0-9]+(?:-[a-z0-9]+)*) \[", re.M)


@dataclass
class ToolCall:
    name: str
    arguments: str
    result: str | None = None
    error: bool = False


@dataclass
class SessionDigest:
    session_id: str
    task: str
    category: str
    #: the reported score; None for an unscored session (the judge may fill ``judged``)
    score: float | None
    unscored: bool
    feedback: str
    turns: int
    tool_calls: list[ToolCall] = field(default_factory=list)
    skills_read: list[str] = field(default_factory=list)
    skills_offered: list[str] = field(default_factory=list)
    goal: str = ""
    final: str = ""
    trajectory: list[str] = field(default_factory=list)
    summary: str | None = None
    #: the judge's overall score of an unscored session (None: not judged, or the judge failed)
    judged: float | None = None

    @property
    def tool_error(self) -> bool:
        return any(call.error for call in self.tool_calls)

    @property
    def effective_score(self) -> float | None:
        """The reported score, else the judge's; never a number the session did not earn."""
        return self.score if self.score is not None else self.judged

    def render(self, max_chars: int = 12000) -> str:
        """The digest as the evolver's prompts quote it."""
        if self.score is not None:
            grade = f"{self.score:.3f} (reported)"
        elif self.judged is not None:
            grade = f"{self.judged:.3f} (judged; the run was not scored)"
        else:
            grade = "unscored (the run errored; no grade)"
        lines = [f"session {self.session_id}", f"task: {self.task}", f"category: {self.category}",
                 f"grade: {grade}", f"turns: {self.turns}",
                 f"skills read: {', '.join(self.skills_read) or 'none'}",
                 f"tool errors: {'yes' if self.tool_error else 'no'}"]
        if self.feedback:
            lines.append(f"grader feedback: {self.feedback}")
        if self.summary:
            lines.append(f"summary: {self.summary}")
        lines.append("trajectory:")
        lines.extend(f"  {step}" for step in self.trajectory)
        text = "\n".join(lines)
        return text if len(text) <= max_chars else text[:max_chars - 20] + "\n  [digest truncated]"


def _clip(text: str, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _arguments(raw: Any) -> dict:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw) if isinstance(raw, str) and raw.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def offered_skills(messages: list[dict]) -> list[str]:
    """Slugs listed by the catalog in the session's system prompt."""
    for message in messages:
        if message.get("role") == "system" and CATALOG_OPEN in (message.get("content") or ""):
            block = message["content"].split(CATALOG_OPEN, 1)[1]
            return _CATALOG_LINE.findall(block)
    return []


def build_digest(sample: Sample, *, skill_tools: tuple[str, ...] | list[str] = ("read_skill",),
                 max_text_chars: int = 1200) -> SessionDigest:
    """The digest of one graded session (see the module docstring)."""
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    feedback = sample.feedback
    if isinstance(feedback, dict):
        feedback = json.dumps(feedback, sort_keys=True)
    digest = SessionDigest(
        session_id=str(sample.report_id or (sample.source_ids[-1] if sample.source_ids else "?")),
        task=_clip(metadata.get("task", ""), 200), category=_clip(metadata.get("category", ""), 64),
        score=sample.reward, unscored=sample.reward is None, feedback=_clip(feedback or "", max_text_chars),
        turns=sum(1 for m in sample.messages if m.get("role") == "assistant"),
        skills_offered=offered_skills(sample.messages))
    calls: dict[str, ToolCall] = {}
    pending: list[ToolCall] = []
    for message in sample.messages:
        role = message.get("role")
        content = message.get("content") or ""
        if role == "user":
            if not digest.goal:
                digest.goal = _clip(content, max_text_chars)
            digest.trajectory.append(f"user: {_clip(content, max_text_chars)}")
        elif role == "assistant":
            if content:
                digest.trajectory.append(f"assistant: {_clip(content, max_text_chars)}")
                digest.final = _clip(content, max_text_chars)
            for raw in message.get("tool_calls") or ():
                function = raw.get("function") or {}
                call = ToolCall(name=str(function.get("name") or "?"),
                                arguments=_clip(function.get("arguments") or "", max_text_chars))
                digest.tool_calls.append(call)
                if raw.get("id"):
                    calls[str(raw["id"])] = call
                pending.append(call)
                digest.trajectory.append(f"assistant calls {call.name}({call.arguments})")
                if call.name in skill_tools:
                    args = _arguments(function.get("arguments"))
                    slug = args.get("slug") or args.get("name")
                    if isinstance(slug, str) and slug and slug not in digest.skills_read:
                        digest.skills_read.append(slug)
        elif role == "tool":
            call = calls.get(str(message.get("tool_call_id"))) if message.get("tool_call_id") else None
            if call is None and pending:
                call = pending[0]
            pending = [c for c in pending if c is not call]
            error = bool(_ERROR.match(content))
            if call is not None:
                call.result = _clip(content, max_text_chars)
                call.error = error
            name = call.name if call is not None else "?"
            digest.trajectory.append(f"tool {name} {'ERROR' if error else 'result'}: {_clip(content, max_text_chars)}")
    return digest
