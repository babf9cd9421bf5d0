"""A client of the ``ttt`` HTTP contract: plan, sample, score, report, wait for the step to train.

One :meth:`TTTClient.step`:

1. ``GET /reef/scenarios/{s}/ttt/plan`` (polled until it names the expected step);
2. for each group, R chat completions of its prompt through ``/v1/chat/completions`` (the OpenAI SDK, header
   ``x-reef-scenario``), each reply turned into a state: the reply itself (discover mode, through the task's
   ``state_from_reply``) or, in guidance mode, the executor's child of the parent state and the reply's guidance
   (malformed guidance: no executor call, state ``null``, score 0);
3. the state scored by the task's verifier (the task named by the plan, loaded here) and reported with its grid
   coordinates: ``{"score", "references": [receipt], "metadata": {"step", "group", "rollout", "state"}}``;
4. ``GET .../ttt/plan`` polled until the step moves on (it trained, or was dropped), then ``GET .../ttt/archive``.
"""

from __future__ import annotations

import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx
from openai import OpenAI

from reef_ttt.task import load_executor, load_task, parse_guidance, state_from_reply

RECORD_ID_HEADER = "x-reef-agent-record-id"


@dataclass
class StepResult:
    step: int
    rewards: list[float]
    archive: dict
    seconds: float
    malformed: int = 0
    #: guidance mode: the guidance of each rollout, in report order (None when malformed)
    guidance: list = field(default_factory=list)
    #: the state each rollout produced, in report order (None when it produced none), and its prompt's last message
    states: list = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)

    @property
    def mean(self) -> float:
        return sum(self.rewards) / max(len(self.rewards), 1)


@dataclass
class TTTClient:
    base_url: str
    scenario: str
    token: str = "reef"
    timeout: float = 600.0
    max_tokens: int | None = None
    seed: int = 0
    _task: Any = field(default=None, init=False)
    _executor: Callable[..., Any] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        headers = {"x-reef-scenario": self.scenario}
        self.chat = OpenAI(base_url=f"{self.base_url.rstrip('/')}/v1", api_key=self.token, default_headers=headers,
                           max_retries=2)
        self.http = httpx.Client(base_url=self.base_url, timeout=120,
                                 headers={"authorization": f"Bearer {self.token}", **headers})
        self.path = f"/reef/scenarios/{urllib.parse.quote(self.scenario, safe='')}/ttt"

    def close(self) -> None:
        self.http.close()
        self.chat.close()

    # -- reads -----------------------------------------------------------------------------------------------------

    def plan(self) -> dict:
        reply = self.http.get(f"{self.path}/plan")
        reply.raise_for_status()
        return reply.json()

    def archive(self, limit: int = 0) -> dict:
        reply = self.http.get(f"{self.path}/archive", params={"limit": limit} if limit else None)
        reply.raise_for_status()
        return reply.json()

    def wait_for_step(self, step: int) -> dict:
        """The plan once it names ``step`` (polled until ``timeout``)."""
        deadline = time.monotonic() + self.timeout
        while True:
            plan = self.plan()
            if plan["step"] >= step:
                return plan
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {step} did not open within {self.timeout} s (plan says {plan['step']})")
            time.sleep(0.05)

    # -- one step --------------------------------------------------------------------------------------------------

    def _task_of(self, plan: dict) -> Any:
        if self._task is None:
            self._task = load_task(plan["task"], plan.get("task_options") or {})
            if plan["mode"] == "guidance":
                self._executor = load_executor(plan.get("executor"), self._task)
        return self._task

    def rollout(self, plan: dict, group: dict, rollout: int) -> tuple[float, Any, str, str | None]:
        """One sample of a group: ``(score, state, receipt, guidance)`` (guidance None outside guidance mode or when
        malformed)."""
        task = self._task_of(plan)
        extra = {"max_tokens": self.max_tokens} if self.max_tokens else {}
        raw = self.chat.chat.completions.with_raw_response.create(
            model="reef", messages=group["prompt"], temperature=1.0, top_p=1.0, **extra)
        receipt = raw.headers.get(RECORD_ID_HEADER)
        if receipt is None:
            raise RuntimeError("the response carries no receipt header; is this a Reef server?")
        text = raw.parse().choices[0].message.content or ""
        guidance = None
        if plan["mode"] == "guidance":
            guidance = parse_guidance(text, tags=plan.get("guidance_tags", True))
            if guidance is None:
                return 0.0, None, receipt, None
            seed = hash((self.seed, plan["step"], group["group"], rollout)) & 0x7FFFFFFF
            state = self._executor(group["parent"]["state"], guidance, seed=seed)
        else:
            state = state_from_reply(task, text)
        value = task.score(state) if state is not None else None
        return (value if value is not None else 0.0), state, receipt, guidance

    def step(self, expected: int | None = None) -> StepResult:
        started = time.monotonic()
        plan = self.wait_for_step(expected) if expected is not None else self.plan()
        step, rewards, guidance, states, prompts = plan["step"], [], [], [], []
        for group in plan["groups"]:
            asked = str(group["prompt"][-1].get("content", "")) if group["prompt"] else ""
            for r in range(plan["rollouts_per_group"]):
                score, state, receipt, said = self.rollout(plan, group, r)
                guidance.append(said)
                rewards.append(score)
                states.append(state)
                prompts.append(asked)
                body = {"score": score, "references": [receipt],
                        "metadata": {"step": step, "group": group["group"], "rollout": r, "state": state}}
                self.http.post("/reef/report", json=body).raise_for_status()
        self.wait_for_step(step + 1)
        malformed = sum(g is None for g in guidance) if plan["mode"] == "guidance" else 0
        return StepResult(step, rewards, self.archive(), time.monotonic() - started, malformed,
                          guidance if plan["mode"] == "guidance" else [], states, prompts)

    def run(self, steps: int, on_step: Callable[[StepResult], None] | None = None) -> list[StepResult]:
        results = []
        first = self.plan()["step"]
        for k in range(first, first + steps):
            result = self.step(k)
            results.append(result)
            if on_step is not None:
                on_step(result)
        return results
