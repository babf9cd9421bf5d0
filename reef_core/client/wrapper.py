"""``reef-<adapter>``: the command the harness installer writes (``python -m reef_core.client.wrapper``).

    reef-generic [--] COMMAND...       run COMMAND through the capture proxy (other adapters run their agent)
    reef-<adapter> report [--score N] [--feedback TEXT] [--per-receipt]
                                       send the captured receipts as one report (or one per receipt)
    reef-<adapter> update              install the newest release (re-runs the install script)
    reef-<adapter> doctor              check Reef's address, the token, the installed and served releases
    reef-<adapter> pending             list the captured receipts not reported yet

The installer's wrapper script exports ``REEF_URL``, ``REEF_SCENARIO``, ``REEF_ADAPTER``, ``REEF_HARNESS_DIR``,
``REEF_AGENT`` (the agent program; empty for ``generic``), ``REEF_PREFIX``, ``REEF_BIN_DIR`` and the adapter's
environment; ``REEF_TOKEN`` is read from the caller's environment. A run exports to the agent ``REEF_PROXY_URL``,
``OPENAI_BASE_URL`` and ``ANTHROPIC_BASE_URL`` (the proxy) and placeholder provider keys, so no other credential
leaves the machine; the proxy puts ``REEF_TOKEN`` on each relayed call.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys

import httpx

from .core import ReefClient
from .errors import ReefClientError
from .proxy import CaptureProxy
from .spool import Spool
from .tree import read_sidecar
from ..wire import SCENARIO_HEADER

COMMANDS = ("report", "update", "doctor", "pending", "help")
PLACEHOLDER_KEY = "reef-capture-proxy"
MAX_REFERENCES = 100  # the server's cap per report


class Setup:
    """The wrapper's environment, checked once."""

    def __init__(self, env=os.environ):
        missing = [k for k in ("REEF_URL", "REEF_SCENARIO", "REEF_ADAPTER", "REEF_HARNESS_DIR") if not env.get(k)]
        if missing:
            raise SystemExit(f"reef wrapper: {', '.join(missing)} not set; run the reef-<adapter> command the "
                             "installer wrote")
        self.url = env["REEF_URL"].rstrip("/")
        self.scenario = env["REEF_SCENARIO"]
        self.adapter = env["REEF_ADAPTER"]
        self.harness_dir = env["REEF_HARNESS_DIR"]
        self.agent = env.get("REEF_AGENT") or None
        self.token = env.get("REEF_TOKEN") or None
        self.prefix = env.get("REEF_PREFIX") or None

    def client(self) -> ReefClient:
        return ReefClient(self.url, scenario=self.scenario, token=self.token)

    def spool(self) -> Spool:
        return Spool(self.scenario)


def run_agent(setup: Setup, argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    command = [setup.agent, *argv] if setup.agent else argv
    if not command:
        print(f"usage: reef-{setup.adapter} COMMAND... (the agent to run through Reef)", file=sys.stderr)
        return 2
    if shutil.which(command[0]) is None and not os.path.exists(command[0]):
        print(f"reef-{setup.adapter}: {command[0]!r} not found on PATH", file=sys.stderr)
        return 127
    with CaptureProxy(setup.url, setup.scenario, setup.token, setup.spool()) as proxy:
        env = {**os.environ, "REEF_PROXY_URL": proxy.url, "OPENAI_BASE_URL": f"{proxy.url}/v1",
               "ANTHROPIC_BASE_URL": proxy.url, "OPENAI_API_KEY": PLACEHOLDER_KEY,
               "ANTHROPIC_API_KEY": PLACEHOLDER_KEY, "REEF_AGENT_KEY": PLACEHOLDER_KEY}
        env.pop("REEF_TOKEN", None)  # the agent needs none: the proxy adds it
        code = subprocess.call(command, env=env)
    if proxy.captured:
        print(f"reef-{setup.adapter}: {len(proxy.captured)} receipt(s) captured; send feedback with "
              f"`reef-{setup.adapter} report --score N --feedback TEXT`", file=sys.stderr)
    return code


def _report_id(scenario: str, references: list[str], score, feedback) -> str:
    """The same report sent twice (a retry after a lost answer) carries the same id, so Reef stores it once."""
    key = json.dumps([scenario, references, score, feedback], sort_keys=True)
    return "wrp-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:40]


def report(setup: Setup, args) -> int:
    sent = []
    with setup.spool().claim() as receipts, setup.client() as reef:
        ids = [r["record_id"] for r in receipts]
        if not ids:
            print(f"reef-{setup.adapter}: no captured receipts to report (run the agent through "
                  f"reef-{setup.adapter} first)", file=sys.stderr)
            return 1
        groups = [[i] for i in ids] if args.per_receipt else [ids[n:n + MAX_REFERENCES]
                                                              for n in range(0, len(ids), MAX_REFERENCES)]
        for group in groups:
            answer = reef.report(score=args.score, feedback=args.feedback, references=group,
                                 report_id=_report_id(setup.scenario, group, args.score, args.feedback))
            sent.append(answer["agent_record_id"])
    for record_id in sent:
        print(record_id)
    print(f"reef-{setup.adapter}: reported on {len(ids)} receipt(s) in {len(sent)} report(s)", file=sys.stderr)
    return 0


def update(setup: Setup) -> int:
    headers = {SCENARIO_HEADER: setup.scenario}
    if setup.token:
        headers["authorization"] = f"Bearer {setup.token}"
    try:
        response = httpx.get(f"{setup.url}/reef/harness/install", params={"adapter": setup.adapter},
                             headers=headers, timeout=120)
    except httpx.HTTPError as exc:
        print(f"reef-{setup.adapter}: Reef unreachable: {exc}", file=sys.stderr)
        return 1
    if response.status_code != 200:
        print(f"reef-{setup.adapter}: {response.status_code}: {response.text[:500]}", file=sys.stderr)
        return 1
    args = [setup.harness_dir] + ([setup.prefix] if setup.prefix else [])
    env = {**os.environ, "REEF_PYTHON": sys.executable}
    return subprocess.run(["sh", "-s", "--", *args], input=response.content, env=env).returncode


def doctor(setup: Setup) -> int:
    problems = 0

    def line(ok: bool, text: str) -> None:
        nonlocal problems
        problems += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {text}")

    from .. import __version__

    print(f"     reef client {__version__}, adapter {setup.adapter}, scenario {setup.scenario!r}")
    try:
        healthy = httpx.get(f"{setup.url}/healthz", timeout=10).status_code == 200
        line(healthy, f"Reef answers at {setup.url}")
    except httpx.HTTPError as exc:
        line(False, f"Reef at {setup.url} unreachable: {exc}")
        return 1
    served = None
    with setup.client() as reef:
        reef.retries = 0
        try:
            served = reef.harness()["release_id"]
            line(True, "token accepted" if setup.token else "no token needed")
        except ReefClientError as exc:
            line(exc.status not in (401, 403), f"harness of the scenario: {exc.message}")
    installed = (read_sidecar(setup.harness_dir) or {}).get("release_id")
    line(installed is not None, f"installed release {installed} in {setup.harness_dir}")
    if served and installed:
        line(served == installed, "installed release is the one served" if served == installed
             else f"release {served} is served: run reef-{setup.adapter} update")
    if setup.agent:
        line(shutil.which(setup.agent) is not None, f"agent {setup.agent!r} on PATH")
    print(f"     {len(setup.spool().pending())} receipt(s) pending a report")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    setup = Setup()
    if not argv or argv[0] not in COMMANDS:
        return run_agent(setup, argv)
    parser = argparse.ArgumentParser(prog=f"reef-{setup.adapter}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="send the captured receipts as one report")
    rep.add_argument("--score", type=float)
    rep.add_argument("--feedback")
    rep.add_argument("--per-receipt", action="store_true", help="one report per receipt")
    for name in ("update", "doctor", "pending", "help"):
        sub.add_parser(name)
    args = parser.parse_args(argv)
    try:
        if args.command == "report":
            return report(setup, args)
        if args.command == "update":
            return update(setup)
        if args.command == "doctor":
            return doctor(setup)
        if args.command == "pending":
            for receipt in setup.spool().pending():
                print(receipt["record_id"], receipt.get("release_id") or "")
            return 0
        parser.print_help()
        return 0
    except ReefClientError as exc:
        print(f"reef-{setup.adapter}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
