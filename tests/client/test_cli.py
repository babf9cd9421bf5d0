"""``reef report``, ``records``, ``releases``, ``status`` and ``harness pull`` against a live server."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from reef_core.client import ReefClient
from reef_core.client.tree import SIDECAR


def _reef(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("REEF_")}
    return subprocess.run([sys.executable, "-m", "reef_core.cli", *args], env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=120)


def test_cli_commands(live_reef, tmp_path):
    scenario = "cli"
    flags = ["--url", live_reef.url, "--token", live_reef.token, "--scenario", scenario]
    with ReefClient(live_reef.url, scenario=scenario, token=live_reef.token) as reef:
        reef.openai().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        receipt = reef.receipts.last().record_id

    tree = json.dumps({"tree": {"AGENTS.md": "From the CLI.\n"}})
    sent = _reef("report", *flags, "--score", "1", "--feedback", tree, "--reference", receipt, "--json")
    assert sent.returncode == 0, sent.stderr
    report_id = json.loads(sent.stdout)["agent_record_id"]

    # The environment names the server, the token and the scenario as well as the flags do.
    env = {"REEF_URL": live_reef.url, "REEF_TOKEN": live_reef.token, "REEF_SCENARIO": scenario}
    records = json.loads(_reef("records", "--json", env=env).stdout)
    assert [(r["agent_record_id"], r["request_type"]) for r in records] == [(receipt, "inference"),
                                                                            (report_id, "report")]
    table = _reef("records", env=env)
    assert table.returncode == 0 and report_id in table.stdout and "inference" in table.stdout

    with ReefClient(live_reef.url, scenario=scenario, token=live_reef.token) as reef:
        release = reef.wait_for_release(after=None, timeout=60)
    releases = json.loads(_reef("releases", *flags, "--json").stdout)
    assert releases[-1]["release_id"] == release["release_id"]
    assert release["release_id"] in _reef("releases", *flags).stdout

    pulled = _reef("harness", "pull", str(tmp_path / "tree"), *flags, "--json")
    assert pulled.returncode == 0, pulled.stderr
    assert json.loads(pulled.stdout)["written"] == ["AGENTS.md"]
    assert (tmp_path / "tree" / "AGENTS.md").read_text() == "From the CLI.\n" and (tmp_path / "tree" / SIDECAR).exists()

    assert json.loads(_reef("status", *flags, "--json").stdout)["scenario"] == scenario
    overall = _reef("status", "--url", live_reef.url, "--token", live_reef.token)
    assert overall.returncode == 0 and scenario in overall.stdout


def test_cli_errors(live_reef):
    refused = _reef("report", "--url", live_reef.url, "--token", live_reef.token, "--scenario", "cli-errors",
                    "--score", "1", "--reference", "no-such-receipt")
    assert refused.returncode == 1 and "400" in refused.stderr and "not a stored record" in refused.stderr
    assert _reef("records", "--scenario", "x").returncode == 2  # no URL: a usage error
    bad = _reef("report", "--url", live_reef.url, "--scenario", "x", "--metadata", "[1]")
    assert bad.returncode == 2 and "--metadata must be a JSON object" in bad.stderr
