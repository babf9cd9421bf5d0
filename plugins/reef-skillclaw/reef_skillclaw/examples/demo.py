"""The SkillClaw demo, end to end through Reef's HTTP API.

Two scenarios of one Reef server (``+recipe=skillclaw``) run the same days: the *method* scenario reports every
graded session (one report quoting all of the session's receipts), so each day's last report starts a night
that evolves its pool; the *control* scenario reports nothing, so its pool stays the seed pool (the frozen
control of the reference recipe). Each session is the deterministic agent of :mod:`reef_skillclaw.examples`,
served behind a loopback OpenAI-compatible server that is Reef's engine, driven through Reef with the official
``openai`` SDK; its tools run on the client: ``read_skill`` reads ``GET /reef/skills/{slug}``, ``run_task`` is
the environment. One task (``billing-4``) errors in the harness every day: the method reports it with the
unscored sentinel, and it is left out of every pass rate.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
from fastapi import FastAPI, Request

from reef_core.api import serve_asgi, serve_reef as serve

from . import CATEGORIES, RUN_TOOL, TOOLS, agent, grade, run_tool, tasks

METHOD = "skillclaw-method"
CONTROL = "skillclaw-control"
#: Tasks whose harness errors every day: reported unscored (``score: null``, ``metadata.unscored: true``).
UNSCORED_TASKS = frozenset({"billing-4"})
MAX_TURNS = 4


def agent_app() -> FastAPI:
    """The agent behind an OpenAI-compatible ``/v1/chat/completions`` (non-streamed; tool calls allowed)."""
    app = FastAPI()
    app.state.calls = 0

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "agent", "object": "model", "created": 0, "owned_by": "demo"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        app.state.calls += 1
        message = agent(body.get("messages") or [])
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        return {"id": f"chatcmpl-agent-{app.state.calls}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model") or "agent",
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    return app


@contextlib.contextmanager
def serve_demo(data_dir: Path, *extra: str, batch_size: int | None = None) -> Iterator[str]:
    """The agent server and a Reef server using it as its engine; yields Reef's base URL."""
    day = batch_size or len(tasks())
    with serve_asgi(agent_app()) as agent_url, serve([
            "+recipe=skillclaw", "engine.kind=upstream", f"engine.upstream_url={agent_url}",
            f"storage.data_dir={data_dir}", f"recipe.options.batch_size={day}",
            "recipe.options.initial_skills=reef_skillclaw.examples:seed_skills",
            "recipe.options.evolver_model=reef_skillclaw.examples:evolver", *extra]) as url:
        yield url


def run_session(url: str, scenario: str, task: dict) -> tuple[str, list[str], list[dict]]:
    """One agent session through Reef: ``(final answer, receipts, request messages of every turn)``."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="demo", default_headers={"x-reef-scenario": scenario},
                    max_retries=0)
    reader = httpx.Client(base_url=url, headers={"x-reef-scenario": scenario}, timeout=30)

    def read_skill(slug: str) -> str:
        response = reader.get(f"/reef/skills/{slug}")
        return response.json()["text"] if response.status_code == 200 else f"error: no skill {slug!r}"

    messages: list[dict] = [{"role": "user", "content": task["prompt"]}]
    receipts: list[str] = []
    answer = ""
    try:
        for _ in range(MAX_TURNS):
            raw = client.chat.completions.with_raw_response.create(model="agent", messages=messages, tools=TOOLS)
            receipts.append(raw.headers["x-reef-agent-record-id"])
            message = raw.parse().choices[0].message
            if not message.tool_calls:
                answer = message.content or ""
                break
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                              "arguments": c.function.arguments}}
                for c in message.tool_calls]})
            for call in message.tool_calls:
                arguments = json.loads(call.function.arguments or "{}")
                if call.function.name == RUN_TOOL and task["id"] in UNSCORED_TASKS:
                    raise RuntimeError("the harness crashed while running the task")
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": run_tool(task, call.function.name, arguments, read_skill)})
    except RuntimeError:
        answer = ""
    finally:
        reader.close()
        client.close()
    return answer, receipts, messages


def run_day(url: str, scenario: str, *, report: bool) -> dict[str, float]:
    """Every task once; ``{category: pass rate}`` over the scored sessions (reports sent when ``report``)."""
    passed: dict[str, list[float]] = {c: [] for c in CATEGORIES}
    with httpx.Client(base_url=url, headers={"x-reef-scenario": scenario}, timeout=30) as client:
        for task in tasks():
            answer, receipts, _ = run_session(url, scenario, task)
            unscored = task["id"] in UNSCORED_TASKS
            score = None if unscored else grade(task, answer)
            if not unscored:
                passed[task["category"]].append(score)
            if report:
                metadata = {"task": task["id"], "category": task["category"], **({"unscored": True} if unscored
                                                                                   else {})}
                client.post("/reef/report", json={"score": score, "references": receipts,
                                                  "metadata": metadata}).raise_for_status()
    return {c: sum(v) / len(v) for c, v in passed.items()}


def wait_for_night(url: str, scenario: str, night: int, timeout_s: float = 60.0) -> dict:
    """The commit-log row of the scenario's ``night``-th night (1-based; the creation release is not a night), once
    it exists and the pool it published (if any) serves."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, headers={"x-reef-scenario": scenario}, timeout=30) as client:
        while True:
            rows = client.get(f"/reef/scenarios/{scenario}/commits", params={"limit": 100}).json().get("commits", [])
            nights = [row for row in rows if row.get("operation") != "creation"]
            if len(nights) >= night:
                published = nights[night - 1].get("release_id")
                if not published or client.get("/reef/harness").json().get("release_id") == published:
                    return nights[night - 1]
            if time.monotonic() > deadline:
                raise TimeoutError(f"scenario {scenario} did not finish night {night} within {timeout_s} s")
            time.sleep(0.02)


def pool(url: str, scenario: str) -> dict:
    """The scenario's serving pool: ``{release_id, skills: {slug: SKILL.md text}}`` (from ``GET /reef/harness``)."""
    harness = httpx.get(f"{url}/reef/harness", headers={"x-reef-scenario": scenario}, timeout=30).json()
    return {"release_id": harness["release_id"],
            "skills": {path.split("/")[1]: text for path, text in harness["files"].items()}}


def run_days(url: str, days: int = 4, *, log: Callable[[str], None] = print) -> dict:
    """Run ``days`` days of the method and the control against the Reef server at ``url``.

    Returns ``method`` / ``control``: per-day ``{category: pass rate}``; ``method_pools[d]`` / ``control_pools[d]``:
    the pool serving after day ``d + 1`` (after its night); ``nights[d]``: the commit-log row of that night."""
    history: dict = {"method": [], "control": [], "method_pools": [], "control_pools": [], "nights": []}
    for day in range(1, days + 1):
        control = run_day(url, CONTROL, report=False)
        method = run_day(url, METHOD, report=True)
        night = wait_for_night(url, METHOD, day)
        history["control"].append(control)
        history["method"].append(method)
        history["nights"].append(night)
        history["control_pools"].append(pool(url, CONTROL))
        history["method_pools"].append(pool(url, METHOD))
        changes = (night.get("metrics") or {}).get("changes", 0)
        log(f"day {day}: method {_rates(method)} | control {_rates(control)} | night: "
            + (f"{changes} change(s), release {night['release_id'][:12]}" if night.get("release_id")
               else "no change"))
    history["releases"] = httpx.get(f"{url}/reef/harness/releases", headers={"x-reef-scenario": METHOD},
                                    timeout=30).json()["releases"]
    log(summary(history))
    return history


def run_demo(days: int = 4, *, data_dir: Path | None = None, log: Callable[[str], None] = print) -> dict:
    """:func:`run_days` on a fresh in-process deployment (agent server + Reef) in ``data_dir`` (default: a
    temporary directory)."""
    with contextlib.ExitStack() as stack:
        if data_dir is None:
            data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="reef-skillclaw-demo-")))
        url = stack.enter_context(serve_demo(data_dir))
        return run_days(url, days, log=log)


def _rates(rates: dict[str, float]) -> str:
    return " ".join(f"{c} {rates[c]:.2f}" for c in CATEGORIES)


def control_band(history: dict, category: str) -> tuple[float, float]:
    """Mean and (population) standard deviation of the control's daily pass rates of ``category``."""
    values = [day[category] for day in history["control"]]
    return statistics.fmean(values), statistics.pstdev(values)


def summary(history: dict) -> str:
    lines = ["category   " + " ".join(f"day{d + 1:<5}" for d in range(len(history["method"]))) + " control mean+-sd"]
    for category in CATEGORIES:
        mean, sd = control_band(history, category)
        lines.append(f"{category:<10} " + " ".join(f"{day[category]:<8.2f}" for day in history["method"])
                     + f" {mean:.2f}+-{sd:.2f}")
    return "\n".join(lines)
