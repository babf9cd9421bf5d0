"""The SkillClaw demo world: tasks with hidden environment facts, a deterministic agent and a deterministic evolver.

* :func:`tasks`: 3 categories x 5 tasks; each task has an environment fact (``port 8101``...) the agent must
  state to pass. ``deploy`` and ``database`` tasks fail with a tool error that names the fact; ``billing`` tasks
  fail with an error that does not (nothing to learn from: the control for the "facts in errors" criterion).
* :func:`seed_skills`: the first pool: one ``deploy`` skill that knows none of the facts.
* :func:`agent`: the agent model (OpenAI chat messages + tools in, one assistant message out). It reads the
  catalog injected into its system prompt; when a skill of the task's category is listed it reads it
  (``read_skill``), and it passes only when the skill's body holds the task's fact; otherwise it runs the task
  blind (``run_task``), which fails with the environment's error.
* :func:`run_tool`: the environment: executes the agent's tool calls (``read_skill`` through a callback that
  reads ``GET /reef/skills/{slug}``).
* :func:`evolver`: the evolver model (``fn(messages) -> str``): it answers each SkillClaw stage
  deterministically, learning at most two facts per decision from the errors quoted in the digests.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

CATEGORIES = ("billing", "database", "deploy")
#: Categories whose tool errors name the missing fact (the evolver can learn only these).
LEARNABLE = ("database", "deploy")
TASKS_PER_CATEGORY = 5
FACTS_PER_DECISION = 2
SKILL_TOOL = "read_skill"
RUN_TOOL = "run_task"
TOOLS = [
    {"type": "function", "function": {"name": SKILL_TOOL, "description": "Read a skill of the shared pool.",
                                      "parameters": {"type": "object", "properties": {"slug": {"type": "string"}},
                                                     "required": ["slug"]}}},
    {"type": "function", "function": {"name": RUN_TOOL, "description": "Run the task in its environment.",
                                      "parameters": {"type": "object", "properties": {"setting": {"type": "string"}},
                                                     "required": ["setting"]}}},
]
_TASK = re.compile(r"\[task ([a-z]+-\d+)\]")
_CATALOG = re.compile(r"^- ([a-z0-9-]+) \[([a-z0-9-]+)\]:", re.M)
_EXPECTS = re.compile(r"expects (setting [a-z]+-[0-9]+)")


def _fact(category: str, index: int) -> str:
    return f"setting {category}-{100 + 7 * index + len(category)}"


def tasks() -> list[dict]:
    """Every task: ``{id, category, fact, prompt}``, in a fixed order."""
    out = []
    for category in CATEGORIES:
        for i in range(TASKS_PER_CATEGORY):
            task_id = f"{category}-{i}"
            out.append({"id": task_id, "category": category, "fact": _fact(category, i),
                        "prompt": f"[task {task_id}] Complete this {category} task and state the setting you used."})
    return out


TASKS = {task["id"]: task for task in tasks()}


def seed_skills() -> dict:
    """The first pool: a deploy skill without any of the facts the deploy tasks need."""
    return {"deploy-basics": {
        "category": "deploy",
        "description": "How to ship services to the staging cluster. Use it for every deploy task. "
                       "NOT for: database or billing work.",
        "body": "# Deploying\n\nShip the service with the run_task tool and state the setting you used.",
    }}


# -- the agent -------------------------------------------------------------------------------------------------


def _text(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _call(name: str, arguments: dict, index: int) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{name}_{index}", "type": "function",
         "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def agent(messages: list[dict]) -> dict:
    """The agent's next assistant message (see the module docstring)."""
    system = "\n".join(_text(m.get("content")) for m in messages if m.get("role") in ("system", "developer"))
    user = next((_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
    match = _TASK.search(user)
    task = TASKS.get(match.group(1)) if match else None
    if task is None:
        return {"role": "assistant", "content": "I need a [task <id>] to work on."}
    last = messages[-1]
    calls = sum(1 for m in messages if m.get("role") == "tool")
    if last.get("role") == "user":
        offered = [slug for slug, category in _CATALOG.findall(system) if category == task["category"]]
        if offered:
            return _call(SKILL_TOOL, {"slug": offered[0]}, calls)
        return _call(RUN_TOOL, {"setting": "default"}, calls)
    if last.get("role") == "tool":
        result = _text(last.get("content"))
        previous = messages[-2].get("tool_calls") or [{}]
        name = (previous[0].get("function") or {}).get("name")
        if name == SKILL_TOOL:
            if task["fact"] in result:
                return {"role": "assistant", "content": f"Done: used {task['fact']}."}
            return _call(RUN_TOOL, {"setting": "default"}, calls)
        return {"role": "assistant", "content": "I could not finish the task: the environment refused it."}
    return {"role": "assistant", "content": "Nothing to do."}


def run_tool(task: dict, name: str, arguments: dict, read_skill: Callable[[str], str]) -> str:
    """The environment's answer to one tool call."""
    if name == SKILL_TOOL:
        return read_skill(str(arguments.get("slug", "")))
    if name == RUN_TOOL:
        if task["fact"] in str(arguments.get("setting", "")):
            return "ok"
        if task["category"] in LEARNABLE:
            return f"error: {task['id']} failed: the environment expects {task['fact']}"
        return f"error: {task['id']} failed: request rejected"
    return f"error: unknown tool {name}"


def grade(task: dict, answer: str) -> float:
    """1 when the agent's final answer says it finished with the task's fact, else 0."""
    return 1.0 if (answer or "").startswith("Done") and task["fact"] in answer else 0.0


# -- the evolver ------------------------------------------------------------------------------------------------


def _stage(messages: list[dict]) -> str:
    from reef_skillclaw.prompts import STAGE_LINES

    first = _text(messages[0].get("content")).splitlines()[0] if messages else ""
    return next((stage for stage, line in STAGE_LINES.items() if first == line), "unknown")


def _facts_by_category(text: str) -> dict[str, list[str]]:
    """Facts named by the errors of each quoted session, by the session's category."""
    out: dict[str, list[str]] = {}
    for block in text.split("--- session ")[1:]:
        category = re.search(r"^category: (\S+)", block, re.M)
        if category is None:
            continue
        for fact in _EXPECTS.findall(block):
            facts = out.setdefault(category.group(1), [])
            if fact not in facts:
                facts.append(fact)
    return out


def evolver(messages: list[dict]) -> str:
    """A deterministic evolver model for every SkillClaw stage (see the module docstring)."""
    stage = _stage(messages)
    user = _text(messages[-1].get("content"))
    if stage == "summary":
        return "The agent attempted the task; the digest lists its tool calls and their results."
    if stage == "judge":
        return json.dumps({"completion": 0.0, "quality": 0.0, "efficiency": 0.5, "tool_usage": 0.5,
                           "reason": "the run errored"})
    if stage == "merge":
        bodies = re.findall(r"---\n\n(.*?)(?=\n\nVersion B|\Z)", user, re.S)
        lines: list[str] = []
        for body in bodies:
            for line in body.strip().splitlines():
                if line.strip() and line not in lines:
                    lines.append(line)
        description = re.search(r"^description: (.*)$", user, re.M)
        return json.dumps({"description": description.group(1).strip("'\"") if description else "Merged skill.",
                           "content": "\n".join(lines)})
    facts = _facts_by_category(user)
    if stage == "decide":
        skill = user.partition("\n\nSessions that read it")[0].split("Skill (SKILL.md):\n\n", 1)[-1]
        new = [f for cat in sorted(facts) for f in facts[cat] if f not in skill][:FACTS_PER_DECISION]
        if not new:
            return json.dumps({"action": "skip", "rationale": "no new fact in the errors"})
        found = re.match(r"---\n.*?\n---\n(.*)", skill, re.S)
        body = found.group(1).strip() if found else ""
        content = body + "".join(f"\n- Known {f}." for f in new)
        return json.dumps({"action": "improve_skill", "rationale": "errors name missing settings",
                           "content": content})
    if stage == "create":
        for category in sorted(facts):
            new = facts[category][:FACTS_PER_DECISION]
            return json.dumps({
                "action": "create_skill", "rationale": f"{category} sessions fail on settings named in errors",
                "name": f"{category}-settings", "category": category,
                "description": f"Settings the {category} environment expects. Use it for every {category} task. "
                               "NOT for: other categories.",
                "content": f"# {category} settings\n" + "".join(f"\n- Known {f}." for f in new)})
        return json.dumps({"action": "skip", "rationale": "no fact named in the errors"})
    return json.dumps({"action": "skip", "rationale": "unknown stage"})
