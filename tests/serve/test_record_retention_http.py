"""Record retention over HTTP: the server's background pass compacts, a compacted body reads 410 (Reef's error
naming when and why), its metadata 200 with the ``compacted`` marker, a retry that would replay it 410, and the
counts show in status and ``/metrics``. ``reef gc --records`` on a stopped deployment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from reef_core.observe.records import Record, RecordStore
from reef_core.testing.fixtures import wait_until


@pytest.fixture
def server(reef_server, fake_upstream_url, store_overrides):
    return reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}", *store_overrides,
                       "storage.retention.max_age=1s", "storage.retention.interval_s=0.3",
                       "storage.retention.scenarios=[{pattern: 'keep-*', max_age: forever}]")


def chat(server, scenario, key):
    response = httpx.post(f"{server.url}/v1/chat/completions",
                          headers={"x-reef-scenario": scenario, "Idempotency-Key": key},
                          json={"model": "m", "messages": [{"role": "user", "content": "hello"}]})
    assert response.status_code == 200
    return response.headers["x-reef-agent-record-id"]


def compacted(server, scenario):
    status = httpx.get(f"{server.url}/reef/status").json()
    return status["record_retention"]["compacted"].get(scenario, {}).get("expired", {}).get("records", 0)


def test_a_compacted_record_reads_410_its_metadata_200(server):
    receipt = chat(server, "old", "k1")
    kept = chat(server, "keep-1", "k2")
    wait_until(lambda: compacted(server, "old") == 1, timeout=60, what="the background pass")
    body = httpx.get(f"{server.url}/reef/scenarios/old/records/{receipt}")
    assert body.status_code == 410
    error = body.json()["error"]
    assert error["code"] == "gone" and "compacted by record retention" in error["message"]
    assert "reason: expired" in error["message"]
    meta = httpx.get(f"{server.url}/reef/scenarios/old/records/{receipt}/metadata")
    assert meta.status_code == 200
    row = meta.json()
    assert row["agent_record_id"] == receipt and row["compacted"]["reason"] == "expired"
    assert row["kept"]["route"] == "chat" and "usage" in row["kept"] and row["content_hash"]
    listed = httpx.get(f"{server.url}/reef/scenarios/old/records").json()["records"]
    assert listed[0]["compacted"]["reason"] == "expired"
    # A retry under the same key would replay the reply retention dropped: 410, not a second exchange.
    retry = httpx.post(f"{server.url}/v1/chat/completions", headers={"x-reef-scenario": "old", "Idempotency-Key": "k1"},
                       json={"model": "m", "messages": [{"role": "user", "content": "hello"}]})
    assert retry.status_code == 410 and "compacted" in retry.json()["error"]["message"]
    # The per-scenario rule keeps keep-* forever.
    whole = httpx.get(f"{server.url}/reef/scenarios/keep-1/records/{kept}")
    assert whole.status_code == 200 and whole.json()["compacted"] is None and "response" in whole.json()["payload"]
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'reef_records_compacted_total{reason="expired",scenario="old"} 1.0' in metrics
    spec = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    assert "410" in spec["/reef/scenarios/{scenario}/records/{record_id}"]["get"]["responses"]
    assert "get" in spec["/reef/scenarios/{scenario}/records/{record_id}/metadata"]


def test_reef_gc_records(tmp_path):
    data = tmp_path / "data"
    with RecordStore.open(None, data) as store:
        store.get_or_create_scenario("s", "none")
        old = time.time() - 7200
        store.append_many_sync([Record(record_id=f"r{i}", scenario="s", kind="inference", created_at=old,
                                       payload={"route": "chat", "request": {"x": "y" * 300}}) for i in range(4)])

    def gc(*args):
        return subprocess.run([sys.executable, "-m", "reef_core.cli", "gc", *args, f"storage.data_dir={data}"],
                              capture_output=True, text=True, env=dict(os.environ), timeout=120)

    dry = gc("--records", "--dry-run", "storage.retention.max_age=1h")
    assert dry.returncode == 0, dry.stderr
    found = json.loads(dry.stdout)
    assert found["dry_run"] and found["records"] == 4 and found["scenarios"]["s"]["would_compact"]["expired"]
    assert found["body_bytes_after"] < found["body_bytes_before"]
    done = json.loads(gc("--records", "--scenario", "s", "storage.retention.max_age=1h").stdout)
    assert done["records"] == 4 and done["scenarios"]["s"]["compacted"]["expired"]["records"] == 4
    assert json.loads(gc("--records", "storage.retention.max_age=1h").stdout)["records"] == 0  # idempotent
    unknown = gc("--records", "--scenario", "nope")
    assert unknown.returncode == 2 and "--scenario" in unknown.stderr
    alone = gc("--scenario", "s")
    assert alone.returncode == 2 and "--records" in alone.stderr
