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
    # No scenario: a usage error naming the flag, before any request (nothing listens on port 9).
    unnamed = _reef("records", "--url", "http://127.0.0.1:9")
    assert unnamed.returncode == 2 and "--scenario" in unnamed.stderr and "REEF_SCENARIO" in unnamed.stderr
    bad = _reef("report", "--url", live_reef.url, "--scenario", "x", "--metadata", "[1]")
    assert bad.returncode == 2 and "--metadata must be a JSON object" in bad.stderr


def test_client_commands_default_to_the_local_server(monkeypatch):
    """No --url and no REEF_URL: the server ``reef serve`` starts by default on this machine."""
    import argparse

    from reef_core.client import cli

    monkeypatch.delenv("REEF_URL", raising=False)
    args = argparse.Namespace(command="records", url=None, token=None, scenario="s")
    with cli._client(args) as reef:
        assert str(reef.url).rstrip("/") == cli.DEFAULT_URL == "http://127.0.0.1:8900"
    monkeypatch.setenv("REEF_URL", "http://127.0.0.1:9999")
    with cli._client(args) as reef:
        assert str(reef.url).rstrip("/") == "http://127.0.0.1:9999"


def test_times_read_the_same_whichever_form_the_server_sent():
    from reef_core.client.cli import readable_time

    epoch = 1764633600.25  # 2025-12-02 00:00:00.25 UTC
    assert readable_time(epoch) == readable_time("2025-12-02T00:00:00.250000+00:00") == "2025-12-02 00:00:00"
    assert readable_time("2025-12-02T01:00:00+01:00") == "2025-12-02 00:00:00"
    assert readable_time("2025-12-02T00:00:00Z") == "2025-12-02 00:00:00"
    assert readable_time(None) == readable_time("") == "" and readable_time("soon") == "soon"


def test_the_releases_table_shows_when_each_release_was_made(live_reef):
    scenario = "cli-created"
    with ReefClient(live_reef.url, scenario=scenario, token=live_reef.token) as reef:
        reef.openai().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        reef.report(score=1.0, feedback={"tree": {"AGENTS.md": "Dated.\n"}}, references="last")
        reef.wait_for_release(after=None, timeout=60)
        rows = reef.releases()
    assert rows
    from reef_core.client.cli import readable_time

    table = _reef("releases", "--url", live_reef.url, "--token", live_reef.token, "--scenario", scenario).stdout
    assert readable_time(rows[0]["created_at"]) and readable_time(rows[0]["created_at"]) in table
