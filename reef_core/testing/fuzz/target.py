"""Set-up of a fuzz target: the server flags it needs and the scenarios the strategies start from."""

from __future__ import annotations

import json
from pathlib import Path

from .cases import Case
from .strategies import MODEL, Pools
from .wire import Wire
from .run import Target

INFERENCE_TOKEN = "fuzz-inference-token"
ADMIN_TOKEN = "fuzz-admin-token"
#: Confined to the ``fz-a`` scenario and ``h-*``, with limits high enough never to refuse (the limiter still runs).
SCOPED_TOKEN = "fuzz-scoped-token"
#: Scenarios named ``h-*`` are bound to the harness recipe (gepa), ``k-*`` to the skill-pool recipe (skillclaw,
#: seeded with the demo's pool); the rest to the default recipe (none).
HARNESS_PREFIX = "h-"
SKILLS_PREFIX = "k-"


def server_overrides() -> list[str]:
    """``reef serve`` overrides of a fuzz target (besides the engine): both tokens, a harness and a skills route."""
    seed = "recipe.options.initial_skills=reef_skillclaw.examples:seed_skills"
    return [f"server.tokens=[{INFERENCE_TOKEN}]", f"server.admin_tokens=[{ADMIN_TOKEN}]",
            f"server.scoped_tokens=[{{name:fuzz-scoped,token:{SCOPED_TOKEN},scenarios:[fz-a,'{HARNESS_PREFIX}*'],"
            "rpm:1000000,tpm:100000000,budget_tokens:1000000000}]",
            # The harness scenarios take instructions (POST /reef/train), the others refuse them (auto mode).
            f"routes=[{{pattern:'{HARNESS_PREFIX}*',recipe:gepa,overrides:['recipe.training_mode=hybrid']}},"
            f"{{pattern:'{SKILLS_PREFIX}*',recipe:skillclaw,overrides:['{seed}']}}]", "server.log_level=warning",
            # The plain pool's bodies expire fast, so reads and retries of compacted records (410) are fuzzed too.
            "storage.retention.interval_s=1", "storage.retention.scenarios=[{pattern:'fz-*',max_age:2s}]"]


def prepare(host: str, port: int, pid: int, log_path: Path, deletable: int = 6) -> Target:
    """Create the pool scenarios with one valid chat each (their receipts seed the report strategy)."""
    pools = Pools(INFERENCE_TOKEN, ADMIN_TOKEN, plain=["fz-a", "fz-b"], harness=[f"{HARNESS_PREFIX}fz"],
                  skills=[f"{SKILLS_PREFIX}fz"], deletable=[f"fz-del{i}" for i in range(deletable)],
                  scoped_token=SCOPED_TOKEN)
    wire = Wire(host, port)
    auth = [(b"authorization", f"Bearer {INFERENCE_TOKEN}".encode()), (b"content-type", b"application/json")]
    body = json.dumps({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}).encode()
    for name in pools.plain + pools.harness + pools.skills + pools.deletable:
        case = Case("POST", "/v1/chat/completions", "/v1/chat/completions",
                    [*auth, (b"x-reef-scenario", name.encode())], body)
        reply = wire.request(case.to_bytes(f"{host}:{port}"))
        if reply.status != 200:
            raise RuntimeError(f"set-up chat in {name!r} answered {reply.status}: {reply.body[:300]!r}")
        pools.receipts.setdefault(name, []).append(reply.header("x-reef-agent-record-id"))
    for name in pools.harness:
        case = Case("GET", "", f"/reef/scenarios/{name}/releases", auth[:1])
        reply = wire.request(case.to_bytes(f"{host}:{port}"))
        pools.releases[name] = [row["release_id"] for row in json.loads(reply.body)["releases"]]
    wire.close()
    return Target(host, port, pid, log_path, pools)
