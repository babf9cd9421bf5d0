"""Dataset export over real HTTP (issue #40 item 2): ``GET /reef/scenarios/{s}/export`` and ``reef export``.

Traffic of both dialects, with tool calls, tool results, a stream, tags and scored reports, goes through a server
in front of the fake upstream. The OpenAI lines pass the fine-tuning format checks below (OpenAI's published rules
for chat fine-tuning data) and load with ``datasets``; the ``reef-jsonl`` export imported into a fresh deployment
gives the same records (content hashes) and the same export, byte for byte.
"""

from __future__ import annotations

import json

import httpx
import pytest

from reef_core.cli import main as reef_main

SCENARIO = "export-main"
TOOLS_OPENAI = [{"type": "function", "function": {"name": "lookup", "description": "find a fact",
                                                  "parameters": {"type": "object",
                                                                 "properties": {"text": {"type": "string"}}}}}]
TOOLS_ANTHROPIC = [{"name": "lookup", "description": "find a fact",
                    "input_schema": {"type": "object", "properties": {"text": {"type": "string"}}}}]

# -- OpenAI's chat fine-tuning format (https://platform.openai.com/docs/guides/supervised-fine-tuning) -----------

ROLES = {"system", "user", "assistant", "tool"}
MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "weight"}


def openai_format_errors(line: dict) -> list[str]:
    """What OpenAI's chat fine-tuning checks would refuse in one example (empty: it passes)."""
    errors = []
    if not isinstance(line, dict) or not isinstance(line.get("messages"), list) or not line["messages"]:
        return ["the example needs a non-empty messages list"]
    if set(line) - {"messages", "tools", "parallel_tool_calls"}:
        errors.append(f"unrecognized example keys {sorted(set(line) - {'messages', 'tools'})}")
    for i, message in enumerate(line["messages"]):
        if not isinstance(message, dict):
            errors.append(f"messages[{i}] is not an object")
            continue
        if set(message) - MESSAGE_KEYS:
            errors.append(f"messages[{i}]: unrecognized keys {sorted(set(message) - MESSAGE_KEYS)}")
        role = message.get("role")
        if role not in ROLES:
            errors.append(f"messages[{i}]: role {role!r}")
        content = message.get("content")
        calls = message.get("tool_calls")
        if content is None:
            if not (role == "assistant" and calls):
                errors.append(f"messages[{i}]: content is null without tool_calls")
        elif not isinstance(content, str):
            errors.append(f"messages[{i}]: content is not a string")
        for j, call in enumerate(calls or []):
            fn = call.get("function") if isinstance(call, dict) else None
            if not (isinstance(call, dict) and isinstance(call.get("id"), str) and call.get("type") == "function"
                    and isinstance(fn, dict) and isinstance(fn.get("name"), str)
                    and isinstance(fn.get("arguments"), str)):
                errors.append(f"messages[{i}].tool_calls[{j}] is malformed")
                continue
            try:
                json.loads(fn["arguments"])
            except ValueError:
                errors.append(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON")
        if calls is not None and role != "assistant":
            errors.append(f"messages[{i}]: tool_calls on a {role} message")
        if role == "tool" and not isinstance(message.get("tool_call_id"), str):
            errors.append(f"messages[{i}]: a tool message needs tool_call_id")
    if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in line["messages"]):
        errors.append("no assistant message")
    for j, tool in enumerate(line.get("tools") or []):
        if not (tool.get("type") == "function" and isinstance(tool.get("function", {}).get("name"), str)):
            errors.append(f"tools[{j}] is not a function tool")
    return errors


def test_the_checker_refuses_what_openai_refuses():
    good = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "x"},
                         {"role": "assistant", "content": "done"}]}
    assert openai_format_errors(good) == []
    assert openai_format_errors({"messages": [{"role": "user", "content": "hi"}]}) == ["no assistant message"]
    assert openai_format_errors({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant",
                                                                                 "content": "y"}]})
    assert openai_format_errors({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant",
                                                                                "content": None}]})
    assert openai_format_errors({"messages": [{"role": "assistant", "content": "x", "extra": 1}]})


# -- traffic ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(module_reef_server, fake_upstream_url):
    overrides = ("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}", "engine.upstream_model=fake-model")
    return module_reef_server(*overrides), module_reef_server(*overrides)


def _post(server, path, body, **headers):
    answer = httpx.post(f"{server.url}{path}", json=body, timeout=30,
                        headers={"x-reef-scenario": SCENARIO, **headers})
    assert answer.status_code == 200, answer.text
    return answer


def _record_traffic(server) -> dict[str, str]:
    """Both dialects, plain and with tools; returns receipts by name."""
    receipts = {}
    chat = {"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    receipts["plain"] = _post(server, "/v1/chat/completions", chat, **{"x-reef-tag-session": "s1"}).headers[
        "x-reef-agent-record-id"]
    called = _post(server, "/v1/chat/completions", {**chat, "tools": TOOLS_OPENAI, "tool_choice": "required"})
    receipts["tool_call"] = called.headers["x-reef-agent-record-id"]
    call = called.json()["choices"][0]["message"]["tool_calls"][0]
    history = {"model": "m", "tools": TOOLS_OPENAI, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "a fact"}]}
    receipts["tool_result"] = _post(server, "/v1/chat/completions", history).headers["x-reef-agent-record-id"]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=30, headers={"x-reef-scenario": SCENARIO},
                      json={**chat, "stream": True}) as streamed:
        assert streamed.status_code == 200
        tail = [line for line in streamed.iter_lines() if '"reef"' in line]
    receipts["stream"] = json.loads(tail[0].removeprefix("data: "))["reef"]["agent_record_id"]
    anthropic = {"model": "m", "max_tokens": 32, "system": "be brief", "tools": TOOLS_ANTHROPIC,
                 "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": "hello there"}]}
    used = _post(server, "/v1/messages", anthropic, **{"x-reef-tag-session": "s2"})
    receipts["anthropic_call"] = used.headers["x-reef-agent-record-id"]
    block = next(b for b in used.json()["content"] if b["type"] == "tool_use")
    result = {"model": "m", "max_tokens": 32, "tools": TOOLS_ANTHROPIC, "messages": [
        {"role": "user", "content": "hello there"}, {"role": "assistant", "content": [block]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block["id"], "content": "a fact"}]}]}
    receipts["anthropic_result"] = _post(server, "/v1/messages", result).headers["x-reef-agent-record-id"]
    for name, score in (("plain", 1.0), ("tool_call", 0.25), ("anthropic_call", 0.5)):
        _post(server, "/reef/report", {"score": score, "feedback": f"{name} judged", "references": [receipts[name]]})
    _post(server, "/reef/report", {"score": 0.75, "references": [receipts["plain"]]})  # a later report corrects it
    _post(server, "/reef/report", {"feedback": {"note": "no number"}, "references": [receipts["tool_result"]]})
    return receipts


@pytest.fixture(scope="module")
def recorded(servers):
    return _record_traffic(servers[0])


def _export(server, scenario=SCENARIO, **params) -> httpx.Response:
    return httpx.get(f"{server.url}/reef/scenarios/{scenario}/export", params=params, timeout=30)


def _lines(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.text.splitlines()]


def test_openai_jsonl_passes_the_format_checks_and_loads_with_datasets(servers, recorded, tmp_path):
    datasets = pytest.importorskip("datasets")
    lines = _lines(_export(servers[0]))
    assert len(lines) == 6  # every exchange, no report
    for line in lines:
        assert openai_format_errors(line) == [], line
        assert line["messages"][-1]["role"] == "assistant"
    # The Anthropic exchanges come in OpenAI's shape: a system turn, tool_calls, a tool turn, function tools.
    anthropic_call, anthropic_result = lines[4], lines[5]
    assert anthropic_call["messages"][0] == {"role": "system", "content": "be brief"}
    reply = anthropic_call["messages"][-1]
    assert reply["content"] is None and reply["tool_calls"][0]["function"]["name"] == "lookup"
    assert anthropic_call["tools"][0]["function"]["parameters"]["properties"] == {"text": {"type": "string"}}
    assert [m["role"] for m in anthropic_result["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert anthropic_result["messages"][2]["tool_call_id"] == reply["tool_calls"][0]["id"]
    assert lines[2]["messages"][2] == {"role": "tool", "tool_call_id": lines[1]["messages"][-1]["tool_calls"][0]["id"],
                                       "content": "a fact"}
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    loaded = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "cache"))
    assert loaded.num_rows == 6 and loaded[0]["messages"][-1]["role"] == "assistant"
    scored = _lines(_export(servers[0], scored_only="true"))
    assert len(scored) == 3 and scored[0] == lines[0]


def test_reef_jsonl_round_trips_into_a_fresh_deployment(servers, recorded, tmp_path):
    first = _export(servers[0], format="reef-jsonl")
    envelopes = _lines(first)
    assert [e["request_type"] for e in envelopes].count("report") == 5
    answer = httpx.post(f"{servers[1].url}/reef/records/batch", headers={"x-reef-scenario": SCENARIO},
                        json={"records": envelopes}, timeout=60)
    assert answer.status_code == 200, answer.text
    again = _export(servers[1], format="reef-jsonl")
    assert again.content == first.content  # the same records, payloads and tags, in the same order
    assert _export(servers[1]).content == _export(servers[0]).content
    # Content hashes, read from each store by the CLI's Parquet rows.
    hashes = []
    for server, name in zip(servers, ("a", "b")):
        out = tmp_path / f"{name}.parquet"
        assert reef_main(["export", "--scenario", SCENARIO, "--format", "parquet", "--out", str(out),
                          f"storage.data_dir={server.data_dir}"]) == 0
        pq = pytest.importorskip("pyarrow.parquet")
        hashes.append(pq.read_table(out).column("content_hash").to_pylist())
    assert hashes[0] == hashes[1] and len(hashes[0]) == 6
    # An identical retry of the import stores nothing twice.
    retry = httpx.post(f"{servers[1].url}/reef/records/batch", headers={"x-reef-scenario": SCENARIO},
                       json={"records": envelopes}, timeout=60)
    assert retry.status_code == 200 and _export(servers[1], format="reef-jsonl").content == first.content


def test_dataset_rows_carry_scores_feedback_tags_and_hashes(servers, recorded, tmp_path):
    datasets = pytest.importorskip("datasets")
    out = tmp_path / "ds"
    assert reef_main(["export", "--scenario", SCENARIO, "--format", "hf", "--out", str(out),
                      f"storage.data_dir={servers[0].data_dir}"]) == 0
    rows = {row["record_id"]: row for row in datasets.load_from_disk(str(out))}
    assert set(rows) == {recorded[name] for name in ("plain", "tool_call", "tool_result", "stream", "anthropic_call",
                                                      "anthropic_result")}
    plain = rows[recorded["plain"]]
    assert plain["scores"] == [1.0, 0.75] and plain["score"] == 0.75 and plain["feedback"] == ["plain judged"]
    assert json.loads(plain["tags"]) == {"session": "s1"} and plain["reply"]["role"] == "assistant"
    assert len(plain["content_hash"]) == 64 and plain["dialect"] == "openai" and plain["scenario"] == SCENARIO
    assert rows[recorded["tool_result"]]["feedback"] == ['{"note":"no number"}']
    assert rows[recorded["tool_result"]]["score"] is None
    call = rows[recorded["anthropic_call"]]
    assert call["dialect"] == "anthropic" and call["reply"]["tool_calls"][0]["function"]["name"] == "lookup"
    assert json.loads(call["tools"])[0]["function"]["name"] == "lookup"
    scored = tmp_path / "scored.jsonl"
    assert reef_main(["export", "--scenario", SCENARIO, "--scored-only", "--out", str(scored),
                      f"storage.data_dir={servers[0].data_dir}"]) == 0
    assert len(scored.read_text().splitlines()) == 3


def test_since_cuts_by_sequence_and_time(servers, recorded):
    everything = _lines(_export(servers[0], format="reef-jsonl"))
    after_two = _lines(_export(servers[0], format="reef-jsonl", since="2"))  # sequences 1 and 2 are left out
    kept = {e["agent_record_id"] for e in everything[2:] if e["request_type"] == "inference"}
    assert [e for e in after_two if e["request_type"] == "inference"] == [
        e for e in everything[2:] if e["request_type"] == "inference"]
    assert [e for e in after_two if e["request_type"] == "report"] == [
        e for e in everything if e["request_type"] == "report" and set(e["payload"]["references"]) <= kept]
    assert _lines(_export(servers[0], since="2000-01-01T00:00:00Z")) == _lines(_export(servers[0]))
    assert _lines(_export(servers[0], since="2999-01-01")) == []
    # A report quoting a record the cut left out is left out too (it could not be imported).
    late = _lines(_export(servers[0], format="reef-jsonl", since="6"))
    assert [e["request_type"] for e in late] == []


@pytest.mark.parametrize("params, status, param", [
    ({"format": "hf"}, 400, "format"), ({"format": "parquet"}, 400, "format"), ({"format": "xml"}, 400, "format"),
    ({"since": "yesterday"}, 400, "since"), ({"since": "9" * 30}, 400, "since"), ({"release": "zz"}, 400, "release"),
    ({"release": "0123456789abcdef"}, 404, "release"), ({"scored_only": "perhaps"}, 400, "scored_only"),
    ({"since": "x" * 100}, 400, "since"),
])
def test_the_route_names_each_bad_parameter(servers, recorded, params, status, param):
    answer = _export(servers[0], **params)
    assert answer.status_code == status, answer.text
    assert param in answer.json()["error"]["message"]


def test_an_unknown_scenario_is_a_404(servers):
    assert _export(servers[0], "no-such-scenario").status_code == 404
    assert _export(servers[0], "bad%09name").status_code in (400, 404)


def test_the_import_refuses_a_malformed_stored_exchange(servers, recorded):
    envelope = next(e for e in _lines(_export(servers[0], format="reef-jsonl")) if e["request_type"] == "inference")
    bad = [({"extra": 1}, "extra"), ({"route": "responses"}, "payload.route"),
           ({"dialect": "anthropic"}, "payload.dialect"), ({"stream": "yes"}, "payload.stream"),
           ({"tokens": {"prompt_ids": [1], "output_ids": [2], "output_logprobs": []}}, "payload.tokens"),
           ({"imported": False}, "payload.imported"), ({"timings": {"engine_ms": "fast"}}, "payload.timings"),
           ({"retry_of": "no/such"}, "payload.retry_of")]
    for change, field in bad:
        body = {**envelope, "agent_record_id": "bad-1", "payload": {**envelope["payload"], **change}}
        answer = httpx.post(f"{servers[1].url}/reef/records", headers={"x-reef-scenario": "export-bad"}, json=body)
        assert answer.status_code == 400 and field in answer.json()["error"]["message"], (change, answer.text)
    answer = httpx.post(f"{servers[1].url}/reef/records", headers={"x-reef-scenario": "export-bad"},
                        json={**envelope, "agent_record_id": "bad-2", "tags": {"a": 1}})
    assert answer.status_code == 400 and "tags" in answer.json()["error"]["message"]
    assert httpx.get(f"{servers[1].url}/reef/scenarios/export-bad/records").status_code == 404


def test_cli_flags_are_checked_first(servers, recorded, tmp_path, capsys, monkeypatch):
    data = f"storage.data_dir={servers[0].data_dir}"
    cases = [
        (["--since", "soon"], "--since"), (["--format", "csv"], "--format"), (["--format", "hf"], "--out"),
        (["--release", "nothex"], "--release"), (["--release", "abcdef0123"], "--release"),
        (["--out", str(tmp_path / "missing" / "x.jsonl")], "--out"),
    ]
    for extra, flag in cases:
        assert reef_main(["export", "--scenario", SCENARIO, *extra, data]) == 2, extra
        assert flag in capsys.readouterr().err, extra
    assert reef_main(["export", "--scenario", "nope", data]) == 2
    assert repr(SCENARIO) in capsys.readouterr().err  # the known scenarios are named
    assert reef_main(["export", "--scenario", SCENARIO, f"storage.data_dir={tmp_path / 'empty'}"]) == 2
    assert "storage.data_dir" in capsys.readouterr().err and not (tmp_path / "empty").exists()
    import reef_core.extras as extras

    monkeypatch.setattr(extras, "_installed", lambda name: name not in ("datasets", "pyarrow"))
    assert reef_main(["export", "--scenario", SCENARIO, "--format", "parquet", "--out", str(tmp_path / "p"),
                      data]) == 2
    assert "pip install 'reef-core[export]'" in capsys.readouterr().err
    assert reef_main(["export", "--scenario", SCENARIO, data]) == 0  # openai-jsonl needs nothing extra
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 6 and all(openai_format_errors(json.loads(line)) == [] for line in out)


def test_the_route_is_in_the_openapi_document(servers):
    document = httpx.get(f"{servers[0].url}/openapi.json", timeout=30).json()
    operation = document["paths"]["/reef/scenarios/{scenario}/export"]["get"]
    assert {p["name"] for p in operation["parameters"] if p["in"] == "query"} == {
        "format", "since", "release", "scored_only"}
    assert "application/x-ndjson" in operation["responses"]["200"]["content"]


def test_release_selects_what_a_release_served(module_reef_server, fake_upstream_url, tmp_path):
    server = module_reef_server("+recipe=gepa", "engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}")
    scenario = "export-harness"
    for text in ("one", "two"):
        answer = httpx.post(f"{server.url}/v1/chat/completions", headers={"x-reef-scenario": scenario}, timeout=30,
                            json={"model": "m", "messages": [{"role": "user", "content": text}]})
        assert answer.status_code == 200, answer.text
    releases = httpx.get(f"{server.url}/reef/scenarios/{scenario}/releases").json()["releases"]
    seed = releases[-1]["release_id"]
    served = _lines(_export(server, scenario, format="reef-jsonl", release=seed[:7]))
    assert len(served) == 2 and all(e["payload"]["release_id"] == seed for e in served)
    assert _export(server, scenario, release="f" * 40).status_code == 404
    out = tmp_path / "rows.parquet"
    assert reef_main(["export", "--scenario", scenario, "--release", seed, "--format", "parquet", "--out", str(out),
                      "+recipe=gepa", f"storage.data_dir={server.data_dir}"]) == 0
    pq = pytest.importorskip("pyarrow.parquet")
    assert pq.read_table(out).column("release").to_pylist() == [seed, seed]
