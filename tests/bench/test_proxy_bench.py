"""bench proxy's latency rows (the plain client and the openai SDK, each against the stub through itself) and the
throughput ratio over the stub (issue #41's rows)."""

from __future__ import annotations

from bench import common, proxy, throughput


def test_sdk_rows_are_measured_against_the_stub_through_the_sdk(tmp_path):
    stub = common.start_stub(tmp_path)
    other = common.start_stub(tmp_path)  # stands in for Reef: the same answers, no receipts
    try:
        result = proxy.latency({"stub": stub, "reef": other}, rounds=2, per_round=3, warmup=1, sdk=True)
    finally:
        other.stop()
        stub.stop()
    stats, added = result["latency_ms"], result["added_ms"]
    assert set(stats) == {"stub", "reef", "stub-sdk", "reef-sdk"}
    assert all(s["p50"] > 0 for s in stats.values())
    assert set(added) == {"reef", "reef-sdk"}
    assert added["reef-sdk"]["p50"] == round(stats["reef-sdk"]["p50"] - stats["stub-sdk"]["p50"], 3)
    assert added["reef"]["p50"] == round(stats["reef"]["p50"] - stats["stub"]["p50"], 3)
    assert result["reef_requests"] == 12 and result["reef_receipts"] == 0  # the stand-in gives none
    # the SDK rows share their process's CPU figure (per request it served, whichever client sent it)
    assert result["server_cpu_ms_per_request"]["reef-sdk"] == result["server_cpu_ms_per_request"]["reef"]


def test_stub_share_is_the_proxys_rate_over_the_stubs_at_that_concurrency():
    rows = [{"target": "stub", "connections": 64, "rps": 4000.0}, {"target": "reef", "connections": 64, "rps": 1000.0},
            {"target": "reef", "connections": 1, "rps": 300.0}, {"target": "reef-w2", "connections": 64, "rps": 2200.0}]
    assert throughput.stub_share(rows) == 0.25
    assert throughput.stub_share(rows, target="reef-w2") == 0.55
    assert throughput.stub_share(rows, connections=1) == 0.0  # no stub row at one connection
    assert throughput.stub_share([r for r in rows if r["target"] != "stub"]) == 0.0
