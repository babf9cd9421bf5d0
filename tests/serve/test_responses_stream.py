"""The live Responses stream writer: chat chunks become typed events as they arrive, with the item ids and order of
the terminal response, and whatever the chunks never opened is emitted whole before the terminal event."""

from __future__ import annotations

import json

from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from reef_core.serve.routes.responses import LiveStream, response_object

EVENT = TypeAdapter(ResponseStreamEvent)
BODY = {"model": "m", "input": "hi"}


def chunk(**delta) -> dict:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def run(chunks: list[dict], message: dict, finish: str = "stop") -> list[dict]:
    live = LiveStream(BODY, "r1", 0.0)
    frames = live.start("m")
    for c in chunks:
        frames += live.feed(c)
    completion = {"model": "m", "choices": [{"message": message, "finish_reason": finish}],
                  "usage": {"prompt_tokens": 2, "completion_tokens": 3}}
    frames += live.finish(response_object(BODY, completion, "r1", 0.0))
    events = [json.loads(f.decode().split("data: ", 1)[1]) for f in frames]
    for e in events:
        EVENT.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_text_arrives_as_deltas_of_the_final_message():
    events = run([chunk(role="assistant", content=""), chunk(content="Hel"), chunk(content="lo")],
                 {"role": "assistant", "content": "Hello"})
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["Hel", "lo"]
    assert events[-1]["type"] == "response.completed" and events[-1]["reef"] == {"agent_record_id": "r1"}
    assert events[-1]["response"]["output"][0]["id"] == "msg_r1"
    assert [e["type"] for e in events].count("response.output_item.done") == 1


def test_calls_stream_after_text_in_output_order():
    call = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "echo", "arguments": '{"te'}}
    events = run([chunk(content="Let me."), chunk(tool_calls=[call]),
                  chunk(tool_calls=[{"index": 0, "function": {"arguments": 'xt": 1}'}}])],
                 {"role": "assistant", "content": "Let me.", "tool_calls": [
                     {"id": "call_a", "type": "function", "function": {"name": "echo", "arguments": '{"text": 1}'}}]},
                 finish="tool_calls")
    kinds = [e["type"] for e in events]
    # The message closes before the call opens: Responses items follow one another.
    assert kinds.index("response.output_text.done") < kinds.index("response.function_call_arguments.delta")
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert args == '{"text": 1}'
    output = events[-1]["response"]["output"]
    assert [item["id"] for item in output] == ["msg_r1", "fc_r1_0"] and output[1]["call_id"] == "call_a"


def test_an_empty_answer_still_gets_its_message_item():
    events = run([chunk(role="assistant", content="")], {"role": "assistant", "content": ""}, finish="length")
    kinds = [e["type"] for e in events]
    assert "response.output_item.added" in kinds and "response.output_item.done" in kinds
    assert kinds[-1] == "response.incomplete"
