"""SIGKILL `reef serve` while clients hammer it: every receipt any client received survives the restart.

Client threads (plain and streaming, OpenAI and Anthropic) send requests as fast as the server answers, each one
unique, and keep every receipt they get. Once enough receipts are out, the server is SIGKILLed (no flush, no
shutdown hook), then restarted on the same data directory. The store must then hold every receipted record exactly
once, complete, with the request it answered; records without a receipt can only be the requests that were in
flight at the kill (at most one per client).
"""

from __future__ import annotations

import json
import threading

import httpx

CLIENTS = 6
#: Bounds on the load: the kill comes after KILL_AFTER receipts, and no client sends more than MAX_PER_CLIENT.
KILL_AFTER = 120
MAX_PER_CLIENT = 400
SCENARIO = "crash"


class Hammer(threading.Thread):
    """One client: sends requests until the server stops answering (or its budget is spent)."""

    def __init__(self, url: str, index: int, progress: threading.Condition):
        super().__init__(name=f"hammer-{index}", daemon=True)
        self.url, self.index = url, index
        self.stream = index % 2 == 1
        self.anthropic = index % 3 == 2
        self.progress = progress
        self.receipts: dict[str, str] = {}  # receipt -> the prompt it answered
        self.failures = 0
        self.unexpected: list[str] = []

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30, headers={"x-reef-scenario": SCENARIO}) as client:
            for n in range(MAX_PER_CLIENT):
                prompt = f"client {self.index} request {n}"
                try:
                    receipt = self._call(client, prompt)
                except httpx.HTTPError:
                    self.failures += 1  # the server died under us: that request has no receipt
                    return
                if receipt is None:
                    continue
                with self.progress:
                    self.receipts[receipt] = prompt
                    self.progress.notify_all()

    def _call(self, client: httpx.Client, prompt: str) -> str | None:
        path = "/v1/messages" if self.anthropic else "/v1/chat/completions"
        body = {"model": "m", "max_tokens": 32, "messages": [{"role": "user", "content": prompt}]}
        if not self.stream:
            response = client.post(path, json=body)
            if response.status_code != 200:
                self.unexpected.append(f"{response.status_code}: {response.text[:200]}")
                return None
            return response.headers["x-reef-agent-record-id"]
        receipt = None
        with client.stream("POST", path, json={**body, "stream": True}) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[len("data: "):])
                if "error" in data:
                    self.unexpected.append(f"stream error: {data}")
                    return None
                receipt = (data.get("reef") or {}).get("agent_record_id") or receipt
        return receipt


def test_every_receipt_survives_sigkill_under_load(reef_server, fake_upstream_url, records_of):
    server = reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}")
    progress = threading.Condition()
    hammers = [Hammer(server.url, i, progress) for i in range(CLIENTS)]
    for hammer in hammers:
        hammer.start()
    with progress:
        reached = progress.wait_for(lambda: sum(len(h.receipts) for h in hammers) >= KILL_AFTER
                                    or not any(h.is_alive() for h in hammers), timeout=60)
    assert reached, "the clients did not collect enough receipts within 60 s"
    server.kill()  # SIGKILL mid-load
    for hammer in hammers:
        hammer.join(timeout=60)
        assert not hammer.is_alive()
    assert not [u for h in hammers for u in h.unexpected], [u for h in hammers for u in h.unexpected]
    receipts = {r: prompt for h in hammers for r, prompt in h.receipts.items()}
    assert len(receipts) == sum(len(h.receipts) for h in hammers)  # no receipt handed out twice
    assert len(receipts) >= KILL_AFTER
    assert all(h.failures == 1 for h in hammers), "every client should have lost the server mid-load"

    server.start()  # same data directory, same port
    rows = records_of(server.url, SCENARIO)
    stored = {r["agent_record_id"]: r for r in rows}
    assert len(stored) == len(rows), "a record id appears twice"
    missing = receipts.keys() - stored.keys()
    assert not missing, f"{len(missing)} receipted records were lost: {sorted(missing)[:5]}"
    assert all(stored[r]["complete"] for r in receipts)
    # Only requests in flight at the kill may have been stored without their receipt reaching the client.
    assert len(stored) - len(receipts) <= CLIENTS
    sequences = [r["sequence"] for r in rows]
    assert sequences == sorted(set(sequences))

    # Spot-check content: the record behind a receipt holds the very request that got it.
    for receipt in list(receipts)[:: max(1, len(receipts) // 10)]:
        record = httpx.get(f"{server.url}/reef/scenarios/{SCENARIO}/records/{receipt}", timeout=30).json()
        sent = record["payload"]["request"]["messages"][-1]["content"]
        assert sent == receipts[receipt]

    # The restarted server takes new work in the same scenario.
    response = httpx.post(f"{server.url}/v1/chat/completions", headers={"x-reef-scenario": SCENARIO}, timeout=30,
                          json={"model": "m", "messages": [{"role": "user", "content": "after the crash"}]})
    assert response.status_code == 200
    assert response.headers["x-reef-agent-record-id"] not in stored
    assert max(sequences) < max(r["sequence"] for r in records_of(server.url, SCENARIO))
