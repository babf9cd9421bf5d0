"""#37, nothing lost silently: over HTTP, a callable judge that raises drops every turn as ``judge_failed`` (not a
neutral verdict), counted in the scenario's status and in ``/metrics``, and logged once per scenario and reason."""

from __future__ import annotations

from pathlib import Path

import httpx

from reef_core.testing import wait_until


def raising(*, turn, next_state):
    """The judge under test (loaded by the server from this file's folder)."""
    raise RuntimeError("the rule broke")


def _metric(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_raising_judge_drops_turns_as_judge_failed_counted_and_logged_once(reef_server, fake_upstream_url):
    server = reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}", "recipe.name=claw",
                         "recipe.processor=openclaw", "+recipe.processor_options.batch_size=1",
                         f"+recipe.processor_options.judge={Path(__file__).stem}:raising",
                         "recipe.trainer=reef_core.testing.step_trainer:StepTrainer", "recipe.surface=harness",
                         env={"PYTHONPATH": str(Path(__file__).parent)})
    headers = {"x-reef-scenario": "claw", "x-reef-tag-session": "one"}
    messages = [{"role": "user", "content": "q0"}]
    for i in range(3):  # each request is the next state of the one before: two pairs to judge
        answer = httpx.post(f"{server.url}/v1/chat/completions", headers=headers,
                            json={"model": "m", "messages": messages})
        assert answer.status_code == 200, answer.text
        messages = [*messages, answer.json()["choices"][0]["message"], {"role": "user", "content": f"q{i + 1}"}]

    def status() -> dict:
        return httpx.get(f"{server.url}/reef/scenarios/claw/status").json()

    wait_until(lambda: status()["dropped"].get("judge_failed") == 2, timeout=60, what="two judge_failed drops")
    found = status()
    assert found["dropped"] == {"judge_failed": 2}, found["dropped"]
    assert found["processor"]["openclaw"]["judge"]["failed_votes"] == 2
    assert found["processor"]["openclaw"]["dispatch"] == {"judge_failed": 2}
    metrics = httpx.get(f"{server.url}/metrics").text
    assert _metric(metrics, "reef_samples_dropped_total", scenario="claw", reason="judge_failed") == 2
    log = server.log()
    assert log.count("reason judge_failed") == 1, log  # the drop, once
    assert log.count("RuntimeError") == 1, log  # the judge's own line, once
