"""The evolver's prompts (written for this project).

Each stage has a system prompt whose first line names the stage (:data:`STAGE_LINES`), so logs and stand-in
models can tell the stages apart, and a user prompt built by a function here. Placeholders are filled by plain
concatenation: skill and session text may hold braces.
"""

from __future__ import annotations

STAGE_LINES = {
    "summary": "SkillClaw stage: session summary.",
    "judge": "SkillClaw stage: session judge.",
    "decide": "SkillClaw stage: skill decision.",
    "create": "SkillClaw stage: new skill decision.",
    "merge": "SkillClaw stage: skill merge.",
}

SUMMARY_SYSTEM = STAGE_LINES["summary"] + """
You read the digest of one agent session recorded by a proxy: the task, its grade, the skills the agent read,
and every turn and tool call with its result. Write 8 to 15 plain sentences that explain the session causally:
what the goal was, which path the agent took, whether the skills it read helped or misled it, the turning
points, recurring tool patterns and errors (quote exact error text that names a missing fact), and how it
ended. No lists, no headings, no advice."""

JUDGE_SYSTEM = STAGE_LINES["judge"] + """
The session below was never graded (the run errored before a score existed). Grade it from the digest alone.
Give four numbers between 0 and 1:
  completion: how much of the task was actually done;
  quality: how correct and useful the agent's final answer is;
  efficiency: how direct the path was (few wasted turns or repeated calls);
  tool_usage: whether tools were chosen and called correctly.
Answer with exactly one JSON object and nothing else:
{"completion": 0.0, "quality": 0.0, "efficiency": 0.0, "tool_usage": 0.0, "reason": "one sentence"}"""

DECIDE_SYSTEM = STAGE_LINES["decide"] + """
You maintain a pool of skills shared by every agent of a deployment. Below is one skill and the sessions of
the past day that read it, each with its grade and trajectory. Decide one change for this skill group:
  improve_skill: the body misses or contradicts what the sessions show (a fact, a step, a pitfall). Return
    the whole new body: keep every correct fact, port, endpoint and the structure; change only what the
    evidence supports.
  optimize_description: the body is right but agents pick it for the wrong tasks or miss it for the right
    ones. Return a new description of 2 to 4 sentences that says when to use it and ends with
    "NOT for: ..." conditions.
  create_skill: the sessions need a distinct skill that does not exist yet. Return its name (lowercase
    words joined by hyphens), a 2 to 4 sentence description ending with "NOT for: ..." conditions, a
    category (a lowercase slug) and the body.
  skip: the evidence is thin, mixed or already covered. Prefer skip when in doubt.
Never put credentials, tokens or keys in a skill. Answer with exactly one JSON object and nothing else:
{"action": "improve_skill", "rationale": "...", "content": "new body"}
{"action": "optimize_description", "rationale": "...", "description": "..."}
{"action": "create_skill", "rationale": "...", "name": "...", "description": "...", "category": "...", "content": "..."}
{"action": "skip", "rationale": "..."}"""

CREATE_SYSTEM = STAGE_LINES["create"] + """
You maintain a pool of skills shared by every agent of a deployment. Below are sessions of the past day that
read no skill, each with its grade and trajectory, and the names and descriptions of the skills that exist.
Decide whether one new skill would have helped these sessions:
  create_skill: the sessions share a gap a short, reusable skill would close (a fact named in errors, a
    procedure, a pitfall). Return its name (lowercase words joined by hyphens), a 2 to 4 sentence
    description ending with "NOT for: ..." conditions, a category (a lowercase slug) and the body.
  skip: no shared, reusable gap, or an existing skill already covers it. Prefer skip when in doubt.
Never put credentials, tokens or keys in a skill. Answer with exactly one JSON object and nothing else:
{"action": "create_skill", "rationale": "...", "name": "...", "description": "...", "category": "...", "content": "..."}
{"action": "skip", "rationale": "..."}"""

MERGE_SYSTEM = STAGE_LINES["merge"] + """
Two versions of the same skill must become one. Keep every actionable instruction and fact of both, remove
duplicates, prefer the more concrete guidance where they disagree, and keep the structure readable. Answer
with exactly one JSON object and nothing else:
{"description": "2 to 4 sentences ending with NOT for: ...", "content": "the merged body"}"""


def summary_user(digest_text: str) -> str:
    return "Session digest:\n\n" + digest_text


def judge_user(digest_text: str) -> str:
    return "Session digest:\n\n" + digest_text


def _sessions(digests: list[str]) -> str:
    return "\n\n".join(f"--- session {i + 1} ---\n{text}" for i, text in enumerate(digests))


def decide_user(skill_text: str, digests: list[str]) -> str:
    return ("Skill (SKILL.md):\n\n" + skill_text + "\n\nSessions that read it (" + str(len(digests)) + "):\n\n"
            + _sessions(digests))


def create_user(catalog: list[str], digests: list[str]) -> str:
    existing = "\n".join(catalog) if catalog else "(the pool is empty)"
    return ("Existing skills:\n" + existing + "\n\nSessions that read no skill (" + str(len(digests)) + "):\n\n"
            + _sessions(digests))


def merge_user(existing_text: str, incoming_text: str) -> str:
    return "Version A (in the pool):\n\n" + existing_text + "\n\nVersion B (proposed tonight):\n\n" + incoming_text
