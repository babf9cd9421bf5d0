"""``reef`` commands whose stdout closes early (``reef config | true``, ``reef plugins --json | head -c 600``)
exit quietly with 141 (128 + SIGPIPE, what a shell reports for a program its pipe stopped reading), no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from reef_core.cli import EXIT_BROKEN_PIPE


def _piped(args: list[str], read: int = 0, env: dict | None = None) -> tuple[int, str]:
    """Run ``reef ARGS`` with stdout a real pipe, read READ bytes of it, close it; return (status, stderr)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("REEF_")}
    proc = subprocess.Popen([sys.executable, "-m", "reef_core.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**base, **(env or {})})
    if read:
        proc.stdout.read(read)
    proc.stdout.close()  # the reader is gone, as after `| true` or `| head -c N`
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    return proc.wait(timeout=180), stderr


@pytest.mark.parametrize("args,read", [
    (["config"], 0),                       # reef config | true
    (["config", "+recipe=sao"], 100),      # reef config +recipe=sao | head -c 100
    (["plugins", "--all", "--json"], 600),  # reef plugins --json | head -c 600
    (["recipes"], 0),
])
def test_closed_stdout_exits_quietly(args, read):
    status, stderr = _piped(args, read)
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    assert "Exception ignored" not in stderr, stderr
    # Closed before the child wrote (read=0: it is still starting) it is 141; after head -c N read its share the rest
    # may already sit in the pipe's buffer, and the command ended normally (0), as `cat small | head -c 1` does.
    assert status == EXIT_BROKEN_PIPE if not read else status in (0, EXIT_BROKEN_PIPE), stderr


def test_records_into_a_closed_pipe(live_reef):
    from reef_core.client import ReefClient

    with ReefClient(live_reef.url, scenario="pipes", token=live_reef.token) as reef:
        reef.openai().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    env = {"REEF_URL": live_reef.url, "REEF_TOKEN": live_reef.token, "REEF_SCENARIO": "pipes"}
    status, stderr = _piped(["records"], 0, env=env)
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    assert status == EXIT_BROKEN_PIPE, stderr


def test_open_stdout_still_exits_0():
    result = subprocess.run([sys.executable, "-m", "reef_core.cli", "recipes"], capture_output=True, timeout=180)
    assert result.returncode == 0 and result.stdout
