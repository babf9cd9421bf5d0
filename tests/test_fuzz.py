"""Property-based fuzzing of a real ``reef serve`` over every route (issue #12's acceptance).

Hypothesis strategies (``reef_core/testing/fuzz``) mix valid requests with hostile ones, sent as raw
bytes over a kept-alive socket with valid tokens (and sometimes wrong ones). Invariants over the
whole run: no status >= 500, no dropped connection, no scenario created by a refused request, RSS
growth bounded. The run does not stop at the first failure: the assertion message lists every
distinct failure with its smallest example. ``python -m bench fuzz`` is the long run.
"""

from __future__ import annotations

import json

import httpx
import pytest

from reef_core.testing.fuzz import ADMIN_TOKEN, fuzz, prepare, route_strategies, server_overrides

CASES = 2000
RSS_LIMIT_MIB = 150


def _target(server):
    return prepare("127.0.0.1", server.port, server.proc.pid, server.log_path)


def _operations(server) -> set[str]:
    spec = httpx.get(f"{server.url}/openapi.json", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}).json()
    return {f"{method.upper()} {path}" for path, item in spec["paths"].items() for method in item}


def _check(result, *, cases: int) -> None:
    problems = []
    if result.cases < cases:
        problems.append(f"only {result.cases} cases ran (wanted {cases})")
    if result.rss_growth_mib >= RSS_LIMIT_MIB:
        problems.append(f"RSS grew by {result.rss_growth_mib:.0f} MiB (limit {RSS_LIMIT_MIB})")
    if result.failures:
        problems.append(f"{len(result.failures)} distinct failure(s)")
    assert not problems, "; ".join(problems) + "\n" + result.report()
    print(result.report())  # shown with -s: statuses per route


@pytest.fixture(scope="module")
def upstream_server(module_reef_server, fake_upstream_url):
    return module_reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}", *server_overrides())


def test_every_route_has_a_strategy(upstream_server):
    server = upstream_server
    target = _target(server)
    operations = _operations(server)
    covered = set(route_strategies(target.pools))
    assert operations - covered == set(), f"routes without a fuzz strategy: {sorted(operations - covered)}"
    assert covered - operations == set(), f"strategies of routes the app no longer has: {sorted(covered - operations)}"


def test_fuzz_every_route_upstream_engine(upstream_server):
    server = upstream_server
    target = _target(server)
    result = fuzz(target, CASES, seed=0)
    assert set(result.by_route) == _operations(server), "a route got no case"
    _check(result, cases=CASES)


@pytest.mark.slow
def test_fuzz_inference_and_reports_local_engine(reef_server):
    """Fewer cases on the embedded engine (tiny random model): its own request translation and limits."""
    server = reef_server("engine.kind=local", "engine.model=tiny", "engine.max_new_tokens=4", "engine.seed=0",
                         *server_overrides())
    routes = ["POST /v1/chat/completions", "POST /v1/messages", "POST /v1/messages/count_tokens", "POST /reef/report",
              "GET /reef/harness"]
    result = fuzz(_target(server), 200, seed=1, routes=routes)
    _check(result, cases=200)
    json.dumps(result.to_dict())  # the bench writes it
