"""SSE decoding/encoding: framing rules providers rely on, at every possible chunk boundary."""

from __future__ import annotations

import pytest

from reef_core.engines.base import StreamEvent
from reef_core.engines.sse import SSEDecoder, encode_event, parse_data

WIRE = (
    b": keep-alive comment\r\n"
    b"event: message_start\r\n"
    b'data: {"type":"message_start","text":"h\xc3\xa9llo"}\r\n'
    b"\r\n"
    b"data: first line\n"
    b"data:second line\n"
    b"id: 7\n"
    b"\n"
    b"event: ping\r"
    b"data: {}\r"
    b"\r"
    b"data: [DONE]\n\n"
    b"data: never finished"
)
EXPECTED = [
    ("message_start", '{"type":"message_start","text":"h\u00e9llo"}'),
    (None, "first line\nsecond line"),
    ("ping", "{}"),
    (None, "[DONE]"),
]


def test_decoder_whole_input():
    d = SSEDecoder()
    assert d.feed(WIRE) == EXPECTED
    assert d.has_partial  # the unterminated last event is held, never dispatched


@pytest.mark.parametrize("cut", range(1, len(WIRE)))
def test_decoder_same_events_at_every_split(cut):
    d = SSEDecoder()
    got = d.feed(WIRE[:cut]) + d.feed(WIRE[cut:])
    assert got == EXPECTED


def test_decoder_byte_by_byte():
    d = SSEDecoder()
    got = []
    for i in range(len(WIRE)):
        got += d.feed(WIRE[i:i + 1])
    assert got == EXPECTED


def test_encode_roundtrip():
    events = [StreamEvent("content_block_delta", {"type": "content_block_delta", "text": "a\nb é"}),
              StreamEvent(None, {"choices": []}), StreamEvent(None, "[DONE]")]
    wire = b"".join(encode_event(e) for e in events)
    assert wire.startswith(b"event: content_block_delta\ndata: {")
    decoded = [parse_data(n, data) for n, data in SSEDecoder().feed(wire)]
    assert decoded == events


def test_parse_data_rejects_garbage():
    with pytest.raises(ValueError):
        parse_data(None, '{"broken": ')
