"""The retry lookup runs (on a worker thread) only for a request that names an earlier attempt: a receipt header, an
``Idempotency-Key`` or an SDK retry count above 0. Any other request has nothing to look up and skips the thread
hop; it still gets a fresh record id, and the retries that do name an attempt still replay it."""

from __future__ import annotations

import httpx
import pytest

from reef_core.loop.deployment import Deployment
from reef_core.serve.process.server import serve_reef

CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture
def lookups(monkeypatch):
    """The retry lookups the deployment ran, as the keyword arguments each got."""
    seen: list[dict] = []
    original = Deployment.find_retry

    def counting(self, scenario, request_hash, record_id, **lookup):
        seen.append(lookup)
        return original(self, scenario, request_hash, record_id, **lookup)

    monkeypatch.setattr(Deployment, "find_retry", counting)
    return seen


def test_only_a_request_naming_an_earlier_attempt_is_looked_up(lookups, tmp_path, fake_upstream_url):
    overrides = ["engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                 f"storage.data_dir={tmp_path / 'data'}"]
    with serve_reef(overrides) as url, httpx.Client(base_url=url, timeout=30) as client:
        headers = {"x-reef-scenario": "lookup"}
        first = client.post(CHAT, json=BODY, headers=headers)
        second = client.post(CHAT, json=BODY, headers=headers)
        assert first.status_code == second.status_code == 200
        assert lookups == []  # nothing named an earlier attempt
        receipts = {first.headers["x-reef-agent-record-id"], second.headers["x-reef-agent-record-id"]}
        assert len(receipts) == 2  # each plain request got a record of its own

        keyed = client.post(CHAT, json=BODY, headers={**headers, "idempotency-key": "key-1"})
        replayed = client.post(CHAT, json=BODY, headers={**headers, "idempotency-key": "key-1"})
        sdk = client.post(CHAT, json=BODY, headers={**headers, "x-stainless-retry-count": "1"})
        by_id = client.post(CHAT, json=BODY, headers={**headers, "x-reef-agent-record-id":
                                                      first.headers["x-reef-agent-record-id"]})
    assert [r.status_code for r in (keyed, replayed, sdk, by_id)] == [200] * 4
    assert replayed.headers.get("x-reef-replayed") == "true"
    assert replayed.headers["x-reef-agent-record-id"] == keyed.headers["x-reef-agent-record-id"]
    assert sdk.headers.get("x-reef-replayed") == "true"  # an SDK retry of a body already answered
    assert by_id.headers.get("x-reef-replayed") == "true"
    assert by_id.headers["x-reef-agent-record-id"] == first.headers["x-reef-agent-record-id"]
    assert [bool(x["idempotency_key"]) for x in lookups] == [True, True, False, False]
    assert [x["sdk_retry"] for x in lookups] == [False, False, True, False]
    assert lookups[3]["client_record_id"] == first.headers["x-reef-agent-record-id"]
