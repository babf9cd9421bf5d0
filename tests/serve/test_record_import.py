"""Record import over real HTTP: ``POST /reef/records``, ``POST /reef/records/batch``, ``reef import`` and
``ReefClient.import_records`` (issue #20 item 4)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from reef_core.cli import main as reef_main
from reef_core.client import ReefClient
from reef_core.observe.model import Record
from reef_core.observe.processors.conversation import exchange_of
from reef_core.observe.processors.per_report import PerReportProcessor
from reef_core.observe.records import RecordStore


@pytest.fixture(scope="module")
def server(module_reef_server, fake_upstream_url, store_overrides):
    return module_reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}", *store_overrides)


def openai_exchange(text: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}],
            "response": {"id": "c1", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": f"re: {text}"}, "finish_reason": "stop"}]}}


def anthropic_exchange(text: str) -> dict:
    return {"dialect": "anthropic",
            "request": {"model": "m", "max_tokens": 16, "system": "be brief",
                        "messages": [{"role": "user", "content": text}]},
            "response": {"type": "message", "role": "assistant", "content": [{"type": "text", "text": f"re: {text}"}]},
            "metadata": {"tags": {"source": "log"}}}


def envelope(record_id: str, kind: str, payload: dict) -> dict:
    return {"agent_record_id": record_id, "request_type": kind, "payload": payload}


def post_one(server, scenario, body):
    return httpx.post(f"{server.url}/reef/records", headers={"x-reef-scenario": scenario}, json=body)


def post_batch(server, scenario, records):
    return httpx.post(f"{server.url}/reef/records/batch", headers={"x-reef-scenario": scenario},
                      json={"records": records}, timeout=60)


def rows(server, scenario) -> list[dict] | None:
    response = httpx.get(f"{server.url}/reef/scenarios/{scenario}/records", params={"limit": 100})
    return None if response.status_code == 404 else response.json()["records"]


def detail(server, scenario, record_id) -> dict:
    return httpx.get(f"{server.url}/reef/scenarios/{scenario}/records/{record_id}").json()


def test_one_record_imported_as_served_and_retry_returns_the_receipt(server):
    answer = post_one(server, "imp-one", envelope("ex-1", "inference", openai_exchange("hello")))
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"agent_record_id": "ex-1", "scenario": "imp-one", "request_type": "inference"}
    assert answer.headers["x-reef-agent-record-id"] == "ex-1"
    again = post_one(server, "imp-one", envelope("ex-1", "inference", openai_exchange("hello")))
    assert again.status_code == 200 and again.json() == answer.json()
    report = post_one(server, "imp-one", envelope("ex-1-r", "report", {"score": 1.0, "references": ["ex-1"]}))
    assert report.status_code == 200, report.text
    stored = rows(server, "imp-one")
    assert [(r["agent_record_id"], r["request_type"]) for r in stored] == [("ex-1", "inference"), ("ex-1-r", "report")]
    assert stored[1]["references"] == ["ex-1"] and stored[1]["score"] == 1.0
    payload = detail(server, "imp-one", "ex-1")["payload"]
    assert payload["route"] == "chat" and payload["dialect"] == "openai" and payload["imported"] is True
    messages, reply = exchange_of(Record(record_id="ex-1", scenario="imp-one", kind="inference", payload=payload))
    assert messages == [{"role": "user", "content": "hello"}] and reply["content"] == "re: hello"
    # The same id with other content is a conflict, and changes nothing.
    clash = post_one(server, "imp-one", envelope("ex-1", "inference", openai_exchange("other")))
    assert clash.status_code == 409
    assert len(rows(server, "imp-one")) == 2


def test_batch_in_order_with_in_batch_references_and_anthropic_exchanges(server):
    records = [envelope("b-1", "inference", anthropic_exchange("one")),
               envelope("b-2", "inference", openai_exchange("two")),
               envelope("b-3", "report", {"score": 0.5, "feedback": "ok", "references": ["b-1", "b-2"]})]
    answer = post_batch(server, "imp-batch", records)
    assert answer.status_code == 200, answer.text
    assert [r["agent_record_id"] for r in answer.json()["records"]] == ["b-1", "b-2", "b-3"]
    assert post_batch(server, "imp-batch", records).json() == answer.json()  # identical retry, same receipts
    assert len(rows(server, "imp-batch")) == 3
    stored = detail(server, "imp-batch", "b-1")
    assert stored["payload"]["route"] == "messages" and stored["payload"]["dialect"] == "anthropic"
    messages, reply = exchange_of(Record(record_id="b-1", scenario="s", kind="inference", payload=stored["payload"]))
    assert messages[0] == {"role": "system", "content": "be brief"} and reply["content"] == "re: one"


@pytest.mark.parametrize("bad, needle", [
    ({"agent_record_id": "x", "request_type": "inference"}, "records[2]: missing payload"),
    (envelope("x", "train", {}), "records[2].request_type"),
    (envelope("x", "inference", {"model": "m", "messages": [], "response": {}}), "records[2].payload"),
    (envelope("x", "inference", {"model": "m", "messages": [{"role": "user", "content": "q"}]}),
     "records[2].payload.response"),
    (envelope("x", "report", {"score": True, "references": []}), "records[2].payload: score"),
    (envelope("x", "report", {"score": 1, "references": ["nowhere"]}), "records[2]"),
    (envelope("b0", "inference", openai_exchange("clash")), "records[2]"),
    ({**envelope("x", "inference", openai_exchange("q")), "extra": 1}, "records[2]: unknown field"),
])
def test_a_bad_item_stores_nothing_and_is_named(server, bad, needle):
    scenario = f"imp-bad-{abs(hash(needle)) % 10**8}"
    good = [envelope("b0", "inference", openai_exchange("a")), envelope("b1", "inference", openai_exchange("b"))]
    answer = post_batch(server, scenario, [*good, bad, envelope("b3", "inference", openai_exchange("c"))])
    assert answer.status_code in (400, 409), answer.text
    assert needle in answer.json()["error"]["message"], answer.text
    assert rows(server, scenario) is None  # nothing stored, not even the scenario


@pytest.mark.parametrize("body, status, needle", [
    ({"records": []}, 400, "records must be a list of 1 to 1000"),
    ({"records": [envelope(f"n{i}", "inference", openai_exchange("q")) for i in range(1001)]}, 400, "1 to 1000"),
    ({"records": [], "more": 1}, 400, "unknown field"),
    ({"records": [envelope("big", "inference", openai_exchange("x" * (1024 * 1024)))]}, 413, "records[0]"),
])
def test_batch_door(server, body, status, needle):
    answer = httpx.post(f"{server.url}/reef/records/batch", headers={"x-reef-scenario": "imp-door"}, json=body,
                        timeout=60)
    assert answer.status_code == status, answer.text
    assert needle in answer.json()["error"]["message"]
    assert rows(server, "imp-door") is None


def test_single_route_door(server):
    assert post_one(server, "imp-door1", {"agent_record_id": "a", "request_type": "inference"}).status_code == 400
    missing = httpx.post(f"{server.url}/reef/records", json=envelope("a", "inference", openai_exchange("q")))
    assert missing.status_code == 400 and "x-reef-scenario" in missing.text
    bad_id = post_one(server, "imp-door1", envelope("bad id!", "inference", openai_exchange("q")))
    assert bad_id.status_code == 400 and "agent_record_id" in bad_id.text
    assert rows(server, "imp-door1") is None


def _open_store(server) -> RecordStore:
    """The server's own record store (SQLite in its data dir, or its PostgreSQL schema), opened beside it."""
    options = dict(o.split("=", 1) for o in server.overrides if o.startswith("storage.records_"))
    return RecordStore.open(options.get("storage.records_url"), server.data_dir,
                            schema=options.get("storage.records_schema"))


def conversation_line(i: int) -> str:
    return json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                    {"role": "assistant", "content": f"answer {i}"}], "score": i % 2})


#: Conversations imported by the CLI test: 10,000 records (an inference record and a report each), the issue's
#: acceptance count; about 3 s on SQLite here.
CLI_CONVERSATIONS = 5000


def test_reef_import_cli_then_the_processor_sees_served_exchanges(server, tmp_path, capsys):
    path = tmp_path / "log.jsonl"
    lines = [conversation_line(i) for i in range(CLI_CONVERSATIONS)]
    path.write_text("\n".join(lines) + "\n")
    started = time.perf_counter()
    code = reef_main(["import", str(path), "--url", server.url, "--scenario", "imp-cli", "--json"])
    elapsed = time.perf_counter() - started
    out = capsys.readouterr()
    assert code == 0, out.err
    summary = json.loads(out.out)
    assert summary == {"scenario": "imp-cli", "records": 2 * CLI_CONVERSATIONS, "lines": CLI_CONVERSATIONS}
    # progress on stderr (not a terminal here: a line per tenth, ending at the total)
    progress = [line for line in out.err.splitlines() if line.startswith("importing: ")]
    assert 5 <= len(progress) <= 12 and progress[-1].startswith(f"importing: {2 * CLI_CONVERSATIONS}/")
    print(f"imported {2 * CLI_CONVERSATIONS} records in {elapsed:.2f} s")
    with ReefClient(server.url, scenario="imp-cli") as reef:
        stored = reef.records()
        assert len(stored) == 2 * CLI_CONVERSATIONS
        reports = [r for r in stored if r["request_type"] == "report"]
        assert all(len(r["references"]) == 1 for r in reports)
        first = reef.record(reports[0]["references"][0])
    messages, reply = exchange_of(Record(record_id="r", scenario="s", kind="inference", payload=first["payload"]))
    assert messages == [{"role": "user", "content": "question 0"}] and reply["content"] == "answer 0"
    # The recipe's processor (SAO's and GEPA's per_report) reads the imported records as it reads served ones:
    # one sample per report, with the conversation as prompt and the imported reply as the completion.
    processor = PerReportProcessor("imp-cli", batch_size=CLI_CONVERSATIONS)
    with _open_store(server) as store:
        for record in store.replay("imp-cli"):
            processor.ingest(record)
    batch = processor.pending_batch()
    assert batch is not None and len(batch.samples) == CLI_CONVERSATIONS
    sample = batch.samples[7]
    assert sample.prompt == [{"role": "user", "content": "question 7"}] and sample.completion == "answer 7"
    assert sample.reward == 1.0 and batch.samples[8].reward == 0.0
    # Importing the same file again stores nothing new (ids derive from content).
    assert reef_main(["import", str(path), "--url", server.url, "--scenario", "imp-cli"]) == 0
    assert len(ReefClient(server.url, scenario="imp-cli").records()) == 2 * CLI_CONVERSATIONS


def test_reef_import_names_the_bad_line_and_stores_nothing(server, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([conversation_line(1), json.dumps({"messages": [{"role": "user", "content": "q"}]}),
                               conversation_line(2)]) + "\n")
    code = reef_main(["import", str(path), "--url", server.url, "--scenario", "imp-cli-bad"])
    assert code == 2
    assert f"{path}:2" in capsys.readouterr().err
    assert rows(server, "imp-cli-bad") is None
    # A line the server refuses (a report quoting an unknown receipt) is named by its line number too.
    path.write_text("\n".join([conversation_line(1), json.dumps(envelope("r9", "report", {
        "score": 1, "references": ["unknown-receipt"]}))]) + "\n")
    code = reef_main(["import", str(path), "--url", server.url, "--scenario", "imp-cli-bad"])
    assert code == 1
    assert "(line 2)" in capsys.readouterr().err
    assert rows(server, "imp-cli-bad") is None


def test_client_import_records(server):
    with ReefClient(server.url, scenario="imp-client") as reef:
        seen = []
        receipts = reef.import_records([json.loads(conversation_line(i)) for i in range(5)]
                                       + [envelope("own-1", "inference", openai_exchange("own"))],
                                       batch_size=4, progress=seen.append)
        assert [r["request_type"] for r in receipts] == ["inference", "report"] * 5 + ["inference"]
        assert sum(seen) == 11 and max(seen) <= 4
        assert len(reef.records()) == 11


def test_async_client_import_records(server):
    import asyncio

    from reef_core.client import AsyncReefClient

    async def run():
        async with AsyncReefClient(server.url, scenario="imp-async") as reef:
            first = await reef.import_records([json.loads(conversation_line(i)) for i in range(3)])
            again = await reef.import_records([json.loads(conversation_line(i)) for i in range(3)])
            return first, again, await reef.records()

    first, again, stored = asyncio.run(run())
    assert first == again and len(first) == 6 and len(stored) == 6


def test_the_batch_body_limit_is_a_server_setting(module_reef_server, fake_upstream_url):
    """``server.max_import_body_bytes`` bounds a batch import's body: over it, 413 and nothing stored."""
    small = module_reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                               "server.max_import_body_bytes=4096")
    records = [envelope(f"big-{i}", "inference", openai_exchange("x" * 500)) for i in range(10)]
    refused = post_batch(small, "limited", records)
    assert refused.status_code == 413 and "4096" in refused.text
    assert rows(small, "limited") is None  # nothing stored, the scenario not created
    accepted = post_batch(small, "limited", records[:2])
    assert accepted.status_code == 200, accepted.text
