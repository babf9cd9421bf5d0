"""The scripted user of :mod:`.style` talking to a Reef deployment over HTTP (the official OpenAI SDK).

:func:`run_user` holds sessions of ``turns_per_session`` turns with ``x-reef-tag-session``; each request resends the
whole transcript, so the next request of a session delivers the previous turn's next state. With
``wait_for_learner`` it waits after each session until the scenario's learner has judged every pair and trained every
ready batch, so the next session talks to the newest weights (on-policy and reproducible); without it the user runs
ahead as a live one would.
"""

from __future__ import annotations

import random
import time

import httpx
from openai import OpenAI

from reef_openclaw.examples import style


def _learner_idle(http: httpx.Client, scenario: str) -> bool:
    status = http.get(f"/reef/scenarios/{scenario}/status")
    if status.status_code == 404:
        return True
    status.raise_for_status()
    body = status.json()
    processor = body.get("processor") or {}
    # the learner too: the processor hands a batch over before the step trains and commits it
    return body.get("learner") not in ("running", "scheduled") and not processor.get("ready") \
        and processor.get("batch") is None \
        and not processor.get("pairs_waiting_for_judge")


def run_user(base_url: str, scenario: str, turns: int, *, seed: int = 0, turns_per_session: int = 3,
             token: str = "reef", wait_for_learner: bool = True, wait_timeout_s: float = 120.0,
             window: int = 48, quiet: bool = False) -> dict:
    """Talk ``turns`` turns; return ``{"accepted": [bool per turn], "turns": [{"prompt", "reply", "reward"} per
    turn], "releases": [...]}`` (a turn's prompt is the user's message it answered; its reward 1.0 if accepted)."""
    headers = {"x-reef-scenario": scenario}
    client = OpenAI(base_url=f"{base_url.rstrip('/')}/v1", api_key=token, default_headers=headers, max_retries=2)
    http = httpx.Client(base_url=base_url, headers={"authorization": f"Bearer {token}", **headers}, timeout=60)
    rng = random.Random(seed)
    accepted: list[bool] = []
    log: list[dict] = []
    started = time.monotonic()
    n_session = 0
    try:
        while len(accepted) < turns:
            session = f"{scenario}-{seed}-{n_session}"
            n_session += 1
            messages = [{"role": "user", "content": style.question(rng)}]
            for _ in range(min(turns_per_session, turns - len(accepted))):
                completion = client.chat.completions.create(
                    model="reef", messages=messages, extra_headers={"x-reef-tag-session": session})
                reply = completion.choices[0].message.content or ""
                accepted.append(style.accepted(reply))
                log.append({"prompt": messages[-1]["content"], "reply": reply, "reward": float(accepted[-1])})
                messages += [{"role": "assistant", "content": reply},
                             {"role": "user", "content": style.next_message(reply, rng)}]
                if not quiet and len(accepted) % window == 0:
                    share = sum(accepted[-window:]) / window
                    print(f"{len(accepted):5d} turns  accepted in the last {window}: {share:.2f}  "
                          f"({time.monotonic() - started:.0f} s)", flush=True)
            if wait_for_learner:
                deadline = time.monotonic() + wait_timeout_s
                while not _learner_idle(http, scenario):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the learner of {scenario} did not catch up within {wait_timeout_s} s")
                    time.sleep(0.05)
        releases = http.get(f"/reef/scenarios/{scenario}/releases").json().get("releases", [])
    finally:
        http.close()
        client.close()
    return {"accepted": accepted, "turns": log, "releases": releases}
