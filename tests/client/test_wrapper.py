"""The ``reef-generic`` wrapper: a scripted agent runs through the capture proxy, then one report quotes its
receipts; ``update`` follows a new release and ``doctor`` checks the setup."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import httpx
import pytest

from reef_core.client import ReefClient
from reef_core.client.tree import read_sidecar

SH = shutil.which("dash") or "/bin/sh"

AGENT = textwrap.dedent('''
    """A scripted agent: two OpenAI calls (one streamed) and one Anthropic call, pointed at Reef by the wrapper."""
    import os, anthropic, openai

    chat = openai.OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the wrapper
    chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "step one"}])
    for _ in chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "step two"}], stream=True):
        pass
    anthropic.Anthropic().messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "three"}])
    assert "REEF_TOKEN" not in os.environ and os.environ["OPENAI_API_KEY"] == "reef-capture-proxy"
    print("agent done")
''')


@pytest.fixture
def installed(live_reef, tmp_path, request):
    """``reef-generic`` installed in a temporary HOME for a scenario of the test's own; yields (wrapper, env,
    client, installed release row)."""
    scenario = f"wrapped-{request.node.name}"
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "PATH": f"{home / '.local/bin'}:{os.environ['PATH']}", "REEF_PYTHON": sys.executable,
           "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "TMPDIR": str(home), "REEF_TOKEN": live_reef.token,
           "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    reef = ReefClient(live_reef.url, scenario=scenario, token=live_reef.token)
    reef.openai().chat.completions.create(model="m", messages=[{"role": "user", "content": "seed"}])
    before = next((r["release_id"] for r in reef.releases() if r.get("current")), None)
    reef.report(score=1.0, feedback={"tree": {"AGENTS.md": "v1\n"}})
    first = reef.wait_for_release(after=before, timeout=60)
    script = httpx.get(f"{live_reef.url}/reef/harness/install", params={"adapter": "generic"},
                       headers={"x-reef-scenario": scenario, "authorization": f"Bearer {live_reef.token}"}).text
    done = subprocess.run([SH, "-s", str(home / "harness")], input=script.encode(), cwd=home, env=env,
                          capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    (home / "agent.py").write_text(AGENT)
    yield home / ".local/bin/reef-generic", env, reef, first
    reef.close()


def _wrapper(wrapper, env, *args, check=True):
    done = subprocess.run([str(wrapper), *args], env=env, cwd=env["HOME"], capture_output=True, text=True,
                          timeout=120)
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_agent_run_then_one_report_quoting_its_receipts(installed):
    wrapper, env, reef, _first = installed
    run = _wrapper(wrapper, env, sys.executable, "agent.py")
    assert "agent done" in run.stdout and "3 receipt(s) captured" in run.stderr
    pending = _wrapper(wrapper, env, "pending").stdout.split("\n")
    captured = [line.split()[0] for line in pending if line.strip()]
    assert len(captured) == 3
    rows = {r["agent_record_id"]: r for r in reef.records()}
    assert all(rows[c]["request_type"] == "inference" for c in captured)
    assert [rows[c]["sequence"] for c in captured] == sorted(rows[c]["sequence"] for c in captured)

    sent = _wrapper(wrapper, env, "report", "--score", "0", "--feedback", "it skipped the tests")
    (report_id,) = sent.stdout.split()
    report = reef.record(report_id)
    assert report["request_type"] == "report" and report["references"] == captured
    assert report["score"] == 0 and report["payload"]["feedback"] == "it skipped the tests"
    reports = [r for r in reef.records() if r["request_type"] == "report" and r["references"] == captured]
    assert len(reports) == 1

    again = _wrapper(wrapper, env, "report", "--score", "0", check=False)
    assert again.returncode == 1 and "no captured receipts" in again.stderr  # the receipts were sent once


def test_a_failed_report_keeps_the_receipts(installed):
    wrapper, env, reef, _first = installed
    _wrapper(wrapper, env, sys.executable, "agent.py")
    refused = _wrapper(wrapper, {**env, "REEF_TOKEN": "wrong"}, "report", "--score", "1", check=False)
    assert refused.returncode == 1 and "401" in refused.stderr
    assert len(_wrapper(wrapper, env, "pending").stdout.split("\n")) >= 3  # still pending
    assert _wrapper(wrapper, env, "report", "--score", "1").stdout.strip()


def test_update_and_doctor(installed):
    wrapper, env, reef, first = installed
    assert "installed release is the one served" in _wrapper(wrapper, env, "doctor").stdout
    reef.openai().chat.completions.create(model="m", messages=[{"role": "user", "content": "more"}])
    reef.report(score=1.0, feedback={"tree": {"AGENTS.md": "v2\n", "new.md": "n\n"}})
    second = reef.wait_for_release(after=first["release_id"], timeout=60)
    stale = _wrapper(wrapper, env, "doctor", check=False)
    assert stale.returncode == 1 and "run reef-generic update" in stale.stdout
    _wrapper(wrapper, env, "update")
    harness = env["HOME"] + "/harness"
    assert read_sidecar(harness)["release_id"] == second["release_id"]
    assert open(f"{harness}/AGENTS.md").read() == "v2\n"
    denied = _wrapper(wrapper, {**env, "REEF_TOKEN": "wrong"}, "doctor", check=False)
    assert denied.returncode == 1 and "FAIL harness of the scenario" in denied.stdout
