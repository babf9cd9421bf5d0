"""The README's runnable examples run as pasted (README.md and every plugins/*/README.md).

A fenced block is runnable when the line right before its fence is an HTML comment (invisible on GitHub)::

    <!-- runnable: python server="+recipe=gepa engine.kind=upstream engine.upstream_url={fake_upstream}" -->
    <!-- runnable: sh timeout="120" -->
    <!-- runnable: file path="reef-myrecipe/pyproject.toml" -->

``python`` blocks run with this interpreter in a temporary directory of their own, ``sh`` blocks with ``bash -e``
(the venv's ``bin`` first on ``PATH``) in a view of the repository root (a link to each top-level entry, so
that what a block writes stays out of the checkout), or in their own temporary directory with ``cwd="section"``;
``file`` blocks are written to ``path`` inside that directory before each runnable block of their README section.
``env="NAME=value ..."`` sets variables for the block (``{dir}``: its directory). ``server=`` names the
overrides of a live ``reef serve`` the block talks to (one server per distinct value, shared by the blocks;
``{fake_upstream}`` is the fake provider's URL); its address reaches the block only through ``REEF_URL``. A
block that starts its own server (``reef serve ... &``) listens on ``REEF_PORT`` (the README's 8900 when unset,
a free port here); the block's process group is stopped when it ends. Every block is one test, named by its
README and section heading; a failing block fails with its output.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from reef_core.client.server_process import free_port

ROOT = Path(__file__).resolve().parents[1]
READMES = [ROOT / "README.md", *sorted(ROOT.glob("plugins/*/README.md"))]
MARKER = re.compile(r"^<!--\s*runnable:\s*(?P<kind>python|sh|file)\b(?P<attrs>.*?)-->\s*$")
ATTR = re.compile(r'(\w+)="([^"]*)"')
FENCE = re.compile(r"^(```+|~~~+)")
KINDS_RUN = ("python", "sh")
DEFAULT_TIMEOUT = 120

pytestmark = pytest.mark.slow


@dataclass
class Block:
    readme: Path
    heading: str
    line: int
    kind: str
    attrs: dict[str, str]
    text: str
    index: int = 0  # among the section's runnable blocks
    files: list["Block"] = field(default_factory=list)  # the section's file blocks, for runnable ones

    @property
    def test_id(self) -> str:
        name = f"{self.readme.relative_to(ROOT)}::{self.heading}"
        return name if self.index == 0 else f"{name}[{self.index + 1}]"


def parse(readme: Path) -> list[Block]:
    """The marked blocks of one README; a marker not followed by a fence is an error naming its line."""
    lines = readme.read_text().splitlines()
    blocks: list[Block] = []
    heading, i = "(top)", 0
    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        if fence:  # skip a fenced block, so that '#' lines inside it are not headings
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1))), len(lines))
            i = end + 1
            continue
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        marker = MARKER.match(line)
        if marker:
            where = f"{readme.relative_to(ROOT)}:{i + 1}"
            fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            assert fence, f"{where}: a runnable marker must be followed by a fenced block"
            end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith(fence.group(1))), None)
            assert end is not None, f"{where}: unterminated fenced block"
            attrs = dict(ATTR.findall(marker.group("attrs")))
            unknown = set(attrs) - {"server", "timeout", "path", "cwd", "env"}
            assert not unknown, f"{where}: unknown marker attribute(s) {sorted(unknown)}"
            assert marker.group("kind") != "file" or "path" in attrs, f"{where}: a file block needs path="
            blocks.append(Block(readme, heading, i + 2, marker.group("kind"), attrs, "\n".join(lines[i + 2:end]) + "\n"))
            i = end + 1
            continue
        i += 1
    runnable: list[Block] = []
    for block in blocks:
        section = [b for b in blocks if (b.readme, b.heading) == (block.readme, block.heading)]
        if block.kind in KINDS_RUN:
            block.index = sum(1 for b in runnable if (b.readme, b.heading) == (block.readme, block.heading))
            block.files = [b for b in section if b.kind == "file"]
            runnable.append(block)
    return runnable


BLOCKS = [block for readme in READMES for block in parse(readme)]


def test_blocks_are_found():
    # The convention is in use (a typo in every marker would otherwise pass silently).
    assert len(BLOCKS) >= 5, [b.test_id for b in BLOCKS]
    assert len({b.test_id for b in BLOCKS}) == len(BLOCKS)


@pytest.fixture(scope="module")
def servers(module_reef_server, fake_upstream_url):
    """``servers(overrides)``: the URL of a live server with those overrides, started once per distinct value."""
    started: dict[str, str] = {}

    def get(overrides: str) -> str:
        if overrides not in started:
            args = shlex.split(overrides.replace("{fake_upstream}", fake_upstream_url + "/v1"))
            started[overrides] = module_reef_server(*args).url
        return started[overrides]

    return get


def _write_files(block: Block, directory: Path) -> None:
    for file in block.files:
        target = directory / file.attrs["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(file.text)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.test_id for b in BLOCKS])
def test_readme_block(block: Block, servers, tmp_path_factory):
    directory = tmp_path_factory.mktemp("block")
    _write_files(block, directory)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONUNBUFFERED": "1"}
    env.pop("REEF_URL", None)
    for item in shlex.split(block.attrs.get("env", "")):
        name, _, value = item.partition("=")
        env[name] = value.replace("{dir}", str(directory))
    if "server" in block.attrs:
        env["REEF_URL"] = servers(block.attrs["server"])
    env["REEF_PORT"] = str(free_port())  # for a block that starts its own server
    if block.kind == "python":
        script = directory / "block.py"
        script.write_text(block.text)
        cmd, cwd = [sys.executable, str(script)], directory
    else:
        script = directory / "block.sh"
        script.write_text(block.text)
        cmd = ["bash", "-e", str(script)]
        cwd = directory if block.attrs.get("cwd") == "section" else _checkout_view(directory / "checkout")
    timeout = float(block.attrs.get("timeout", DEFAULT_TIMEOUT))
    output = directory / "output.txt"
    # Output to a file, not a pipe: a server the block left in the background holds its stdout open.
    with open(output, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop_group(proc.pid)
        proc.wait()
        pytest.fail(f"{block.test_id} (line {block.line}) ran past {timeout:g} s:\n{_tail(output)}")
    finally:
        _stop_group(proc.pid)
    assert proc.returncode == 0, (
        f"{block.test_id} (line {block.line}) exited {proc.returncode}:\n{block.text}\n--- output ---\n{_tail(output)}")


def _checkout_view(view: Path) -> Path:
    """A directory that looks like the repository root (a link to each top-level entry), so that a block run "from
    the checkout" finds `.venv/` and `plugins/` but writes what it makes (a PNG, a data directory) elsewhere."""
    view.mkdir()
    for entry in ROOT.iterdir():
        if entry.name != ".git":
            (view / entry.name).symlink_to(entry)
    return view


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-6000:]


def _stop_group(pgid: int) -> None:
    """Stop what the block left running (a `reef serve ... &`): SIGTERM, then SIGKILL after 30 s."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
