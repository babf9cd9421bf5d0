"""Fixtures of the fault tests: one `reef serve` per module (starting one costs seconds), a scenario per test,
and helpers that read back every record of a scenario through the records route."""

from __future__ import annotations

import uuid

import httpx
import pytest

from reef_core.testing.fixtures import ReefProcess, wait_until

#: engine.timeout_s of the shared server: small, so a stalled provider turns into a 504 quickly, yet well above
#: what a healthy call takes on a loaded 2-core CI box.
TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def fault_server(request, tmp_path_factory, fake_upstream_url):
    """A `reef serve` on the upstream engine (SQLite records) with engine.timeout_s=2, shared by the module."""
    data_dir = tmp_path_factory.mktemp("faults") / "data"
    clean_env = {var: "" for var in ("REEF_TOKEN", "REEF_ADMIN_TOKEN", "REEF_UPSTREAM_URL", "REEF_UPSTREAM_API_KEY")}
    proc = ReefProcess(data_dir, ["engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                                           f"engine.timeout_s={TIMEOUT_S}"], env=clean_env)
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture
def scenario():
    """A scenario name of the test's own, so its records can be counted exactly."""
    return f"faults-{uuid.uuid4().hex[:10]}"


def all_records(url: str, scenario: str) -> list[dict]:
    """Every record of ``scenario``, page by page (the route serves at most 100 at a time)."""
    rows: list[dict] = []
    after = 0
    while True:
        response = httpx.get(f"{url}/reef/scenarios/{scenario}/records",
                             params={"after_sequence": after, "limit": 100}, timeout=30)
        if response.status_code == 404 and not rows:
            return []  # the scenario was never created: no record at all
        response.raise_for_status()
        page = response.json()
        rows.extend(page["records"])
        if page["next_after_sequence"] is None:
            return rows
        after = page["next_after_sequence"]


@pytest.fixture
def records_of():
    """``records_of(url, scenario)``: :func:`all_records` as a fixture (test modules cannot import conftest)."""
    return all_records


@pytest.fixture
def wait_for():
    """``wait_for(predicate, timeout=30, what=...)``: :func:`wait_until` as a fixture."""
    return wait_until
