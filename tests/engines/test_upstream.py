"""UpstreamEngine against the FakeUpstream over real loopback HTTP: both dialects, streams and every fault."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

from reef_core.engines.base import HEADERS_EVENT, DirectResponse, EngineRequest
from reef_core.engines.upstream import UpstreamEngine
from reef_core.errors import UpstreamError, UpstreamTimeout, UpstreamUnavailable, ValidationFailed

ROUTE = {"openai": "chat", "anthropic": "messages"}


def _req(dialect, text="hello there world", **extra):
    body = {"model": "m", "messages": [{"role": "user", "content": text}], **extra}
    if dialect == "anthropic":
        body.setdefault("max_tokens", 50)
    return EngineRequest(dialect, ROUTE[dialect], body, {"x-client-trace": "t1", "authorization": "Bearer client",
                                                          "x-reef-scenario": "s"})


async def _collect(engine, req):
    events = []
    try:
        async for ev in engine.stream(req):
            events.append(ev)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return events, exc
    return events, None


def _text(dialect, events):
    if dialect == "openai":
        return "".join(e.data["choices"][0]["delta"].get("content") or "" for e in events
                       if isinstance(e.data, dict) and e.data.get("choices"))
    return "".join(e.data["delta"]["text"] for e in events if e.event == "content_block_delta")


@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
def test_complete_and_stream(fake, api_key, dialect):
    app, url = fake

    async def go():
        async with UpstreamEngine(url, api_key=api_key, dialect=dialect, model="served") as eng:
            r = await eng.complete(_req(dialect, stream=True))  # complete() never asks for a stream
            events, err = await _collect(eng, _req(dialect))
            return r, events, err

    r, events, err = asyncio.run(go())
    assert r.status == 200 and r.tokens is None
    if dialect == "openai":
        assert r.body["choices"][0]["message"]["content"] == "echo: hello there world"
        assert r.body["model"] == "served"
    else:
        assert r.body["content"][0]["text"] == "echo: hello there world"
    assert err is None
    assert events[0].event == HEADERS_EVENT and events[0].data["content-type"].startswith("text/event-stream")
    assert _text(dialect, events) == "echo: hello there world"
    last = events[-1]
    assert last.data == "[DONE]" if dialect == "openai" else last.event == "message_stop"
    log = app.requests_log()
    assert [entry["body"]["stream"] for entry in log] == [False, True]
    headers = log[0]["headers"]
    assert headers["x-client-trace"] == "t1" and "x-reef-scenario" not in headers  # forwarded, minus Reef's
    if dialect == "openai":  # the engine's own credentials replace the client's
        assert headers["authorization"] == f"Bearer {api_key}"
    else:
        assert headers["x-api-key"] == api_key and headers["anthropic-version"] and "authorization" not in headers


def test_url_with_v1_suffix_and_connection_reuse(fake, api_key):
    app, url = fake

    async def go():
        async with UpstreamEngine(url + "/v1/", api_key=api_key) as eng:
            await asyncio.gather(*(eng.complete(_req("openai")) for _ in range(4)))
            for _ in range(20):
                assert (await eng.complete(_req("openai"))).status == 200

    asyncio.run(go())
    stats = app.stats()
    assert stats["requests"] == 24
    assert stats["connections"] <= 4  # keep-alive: sequential requests reuse pooled connections


def test_count_tokens(fake, api_key):
    app, url = fake
    anthropic_body = {"model": "m", "system": "a b", "messages": [{"role": "user", "content": "c d e"}]}
    openai_body = {"model": "m", "messages": [{"role": "system", "content": "a b"},
                                              {"role": "user", "content": "c d e " * 40}]}

    async def go():
        async with UpstreamEngine(url, api_key=api_key, dialect="anthropic") as eng:
            exact = await eng.count_tokens(EngineRequest("anthropic", "count_tokens", anthropic_body, {}))
        async with UpstreamEngine(url, api_key=api_key, dialect="openai") as eng:
            estimate = await eng.count_tokens(EngineRequest("openai", "count_tokens", openai_body, {}))
        async with UpstreamEngine(url, api_key=api_key, dialect="openai", count_tokens_mode="probe") as eng:
            probe = await eng.count_tokens(EngineRequest("openai", "count_tokens", openai_body, {}))
        return exact, estimate, probe

    exact, estimate, probe = asyncio.run(go())
    assert (exact.status, exact.body) == (200, {"input_tokens": 5})
    text_chars = len("a b") + len("c d e " * 40)
    assert estimate.headers["x-reef-token-count"] == "estimate"
    assert text_chars // 4 <= estimate.body["input_tokens"] <= text_chars // 4 + 10
    assert probe.body == {"input_tokens": 122} and probe.headers["x-reef-token-count"] == "probe"
    assert app.requests_log()[-1]["body"]["max_tokens"] == 1  # the probe asked for a single token


ECHO_TOOL = {"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}
COUNTED = {"model": "gpt-4o", "messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "say hello", "name": "ann"}]}


def _count(url, body, **options):
    async def go():
        async with UpstreamEngine(url, dialect="openai", **options) as eng:
            return await eng.count_tokens(EngineRequest("openai", "count_tokens", body, {}))

    return asyncio.run(go())


def test_count_tokens_with_the_providers_tokenizer_is_exact(fake, fake_tool_model_dir):
    from transformers import AutoTokenizer

    _app, url = fake
    tok = AutoTokenizer.from_pretrained(fake_tool_model_dir)
    for tools in (None, [ECHO_TOOL]):
        body = {**COUNTED, **({"tools": tools} if tools else {})}
        out = _count(url, body, tokenizer=str(fake_tool_model_dir))
        rendered = tok.apply_chat_template(body["messages"], tools=tools, add_generation_prompt=True, tokenize=False)
        assert out.headers["x-reef-token-count"] == "tokenizer"
        assert out.body == {"input_tokens": len(tok(rendered, add_special_tokens=False)["input_ids"])}
    # an image part: neither tokenizer sees it as the provider does
    image = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]}
    assert _count(url, image, tokenizer=str(fake_tool_model_dir)).headers["x-reef-token-count"] == "estimate"


def _tiktoken_cache() -> str:
    """The encodings litellm ships (tiktoken's cache layout): this machine cannot download them."""
    import importlib.util

    spec = importlib.util.find_spec("litellm")
    if spec is None or spec.origin is None:
        pytest.skip("litellm (with its tiktoken encodings) is not installed")
    return str(Path(spec.origin).parent / "litellm_core_utils" / "tokenizers")


def test_count_tokens_of_an_openai_model_name_uses_tiktoken(fake, monkeypatch):
    tiktoken = pytest.importorskip("tiktoken")
    _app, url = fake
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", _tiktoken_cache())
    enc = tiktoken.get_encoding("o200k_base")
    # OpenAI's recipe: 3 framing tokens per message, 1 more for a name, 3 priming the reply
    expected = 3 + sum(3 + sum(len(enc.encode(v)) for v in m.values()) for m in COUNTED["messages"]) + 1
    out = _count(url, COUNTED)
    assert (out.headers["x-reef-token-count"], out.body) == ("tiktoken", {"input_tokens": expected})
    with_tools = _count(url, {**COUNTED, "tools": [ECHO_TOOL]})
    assert with_tools.body["input_tokens"] > expected and with_tools.headers["x-reef-token-count"] == "tiktoken"
    # the configured model decides, not the request's
    assert _count(url, {**COUNTED, "model": "m"}, model="gpt-4").headers["x-reef-token-count"] == "tiktoken"
    assert _count(url, {**COUNTED, "model": "my-own-model"}).headers["x-reef-token-count"] == "estimate"


def test_count_tokens_estimates_when_the_encoding_cannot_load_and_says_so_once(fake, monkeypatch, caplog):
    tiktoken = pytest.importorskip("tiktoken")
    _app, url = fake

    def unreachable(name):
        raise ConnectionError("no network")

    monkeypatch.setattr(tiktoken, "get_encoding", unreachable)

    async def go():
        async with UpstreamEngine(url, dialect="openai") as eng:
            return [await eng.count_tokens(EngineRequest("openai", "count_tokens", COUNTED, {})) for _ in range(3)]

    with caplog.at_level("WARNING", logger="reef.engines.token_count"):
        outs = asyncio.run(go())
    assert {o.headers["x-reef-token-count"] for o in outs} == {"estimate"}
    assert len([r for r in caplog.records if "o200k_base" in r.getMessage()]) == 1


def test_upstream_tokenizer_is_checked_at_start(tmp_path):
    from reef_core.builtins.engines import make_upstream_engine
    from reef_core.config.schema import EngineConfig
    from reef_core.errors import ConfigError

    config = EngineConfig(kind="upstream", upstream_url="http://127.0.0.1:9", upstream_tokenizer=str(tmp_path))
    with pytest.raises(ConfigError, match="upstream_tokenizer .* holds no tokenizer"):
        make_upstream_engine(config, tmp_path)
    with pytest.raises(ConfigError, match="is not a directory"):
        make_upstream_engine(EngineConfig(kind="upstream", upstream_url="http://127.0.0.1:9",
                                          upstream_tokenizer=str(tmp_path / "none")), tmp_path)
    with pytest.raises(ConfigError, match="needs engine.upstream_dialect=openai"):
        make_upstream_engine(EngineConfig(kind="upstream", upstream_url="http://127.0.0.1:9",
                                          upstream_dialect="anthropic", upstream_tokenizer=str(tmp_path)), tmp_path)


@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
@pytest.mark.parametrize("stream", [False, True])
def test_4xx_relayed_with_retry_after(fake, api_key, dialect, stream):
    app, url = fake
    app.add_faults({"status": 429, "retry_after": 7}, {"status": 418}, {"status": 422})

    async def go():
        async with UpstreamEngine(url, api_key=api_key, dialect=dialect) as eng:
            out = []
            for _ in range(3):
                if stream:
                    with pytest.raises(DirectResponse) as info:
                        async for _ev in eng.stream(_req(dialect)):
                            pass
                    out.append(info.value.response)
                else:
                    out.append(await eng.complete(_req(dialect)))
            return out

    r429, r418, r422 = asyncio.run(go())
    assert r429.status == 429 and r429.headers["retry-after"] == "7"
    assert "injected fault 429" in str(r429.body)  # the provider's own body is relayed
    assert r418.status == 400  # a 4xx outside the relayed set becomes 400
    assert r422.status == 422


def test_wrong_key_is_relayed_401(fake):
    _, url = fake

    async def go():
        async with UpstreamEngine(url, api_key="wrong", dialect="anthropic") as eng:
            return await eng.complete(_req("anthropic"))

    r = asyncio.run(go())
    assert r.status == 401 and r.body["error"]["type"] == "authentication_error"


def _failed_call(url, api_key, stream):
    """(events, error) of one call that the provider fails (streamed or plain)."""
    async def go():
        async with UpstreamEngine(url, api_key=api_key) as eng:
            if stream:
                return await _collect(eng, _req("openai"))
            try:
                await eng.complete(_req("openai"))
            except Exception as exc:  # noqa: BLE001
                return [], exc

    return asyncio.run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_5xx_raises_upstream_error(fake, api_key, stream):
    app, url = fake
    app.add_faults({"status": 500})
    events, err = _failed_call(url, api_key, stream)
    assert events == []
    assert type(err) is UpstreamError and err.status == 502 and "500" in err.message


@pytest.mark.parametrize("stream", [False, True])
def test_503_raises_upstream_unavailable_with_retry_after(fake, api_key, stream):
    app, url = fake
    app.add_faults({"status": 503, "retry_after": 7})
    events, err = _failed_call(url, api_key, stream)
    assert events == []
    assert type(err) is UpstreamUnavailable and err.status == 503 and err.details["retry_after"] == "7"


@pytest.mark.parametrize("stream", [False, True])
def test_timeout_raises_upstream_timeout(fake, api_key, stream):
    app, url = fake
    app.add_faults({"delay_s": 2.0} if not stream else {"chunk_delay_s": 2.0})

    async def go():
        async with UpstreamEngine(url, api_key=api_key, timeout_s=0.3) as eng:
            t0 = time.monotonic()
            if stream:
                events, err = await _collect(eng, _req("openai"))
            else:
                events = []
                try:
                    await eng.complete(_req("openai"))
                    err = None
                except Exception as exc:  # noqa: BLE001
                    err = exc
            return events, err, time.monotonic() - t0

    events, err, took = asyncio.run(go())
    assert isinstance(err, UpstreamTimeout) and err.status == 504
    assert took < 1.5
    if stream:
        assert events and events[-1].data != "[DONE]"  # what arrived before the stall was delivered


@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
def test_truncated_stream_errors_after_partial_events(fake, api_key, dialect):
    app, url = fake
    app.add_faults({"truncate_after": 3})

    async def go():
        async with UpstreamEngine(url, api_key=api_key, dialect=dialect) as eng:
            return await _collect(eng, _req(dialect))

    events, err = asyncio.run(go())
    assert isinstance(err, UpstreamError) and "stream ended early" in err.message
    assert len([e for e in events if not e.is_reef]) == 3


def test_connection_reset_and_mid_stream_reset(fake, api_key):
    app, url = fake
    app.add_faults({"reset": True}, {"reset_after_events": 2})

    async def go():
        async with UpstreamEngine(url, api_key=api_key) as eng:
            try:
                await eng.complete(_req("openai"))
                first = None
            except Exception as exc:  # noqa: BLE001
                first = exc
            events, second = await _collect(eng, _req("openai"))
            ok = await eng.complete(_req("openai"))  # the pool recovers
            return first, events, second, ok

    first, events, second, ok = asyncio.run(go())
    assert type(first) is UpstreamError and "connection" in first.message
    assert type(second) is UpstreamError and len([e for e in events if not e.is_reef]) == 2
    assert ok.status == 200


@pytest.mark.parametrize("stream", [False, True])
def test_invalid_json_is_an_upstream_error(fake, api_key, stream):
    app, url = fake
    app.add_faults({"invalid_json": True})

    async def go():
        async with UpstreamEngine(url, api_key=api_key) as eng:
            if stream:
                return await _collect(eng, _req("openai"))
            try:
                await eng.complete(_req("openai"))
            except Exception as exc:  # noqa: BLE001
                return [], exc

    events, err = asyncio.run(go())
    assert type(err) is UpstreamError and "invalid JSON" in err.message
    if stream:
        assert len([e for e in events if not e.is_reef]) == 1


@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
def test_stream_error_event_is_an_upstream_error(fake, api_key, dialect):
    app, url = fake
    app.add_faults({"stream_error": True})

    async def go():
        async with UpstreamEngine(url, api_key=api_key, dialect=dialect) as eng:
            return await _collect(eng, _req(dialect))

    events, err = asyncio.run(go())
    assert type(err) is UpstreamError and "stream error" in err.message
    assert len([e for e in events if not e.is_reef]) == 2


def test_oversized_response_is_refused(fake, api_key):
    app, url = fake
    app.add_faults({"oversized_bytes": 300_000}, {"oversized_bytes": 300_000})

    async def go():
        async with UpstreamEngine(url, api_key=api_key, max_response_bytes=100_000) as eng:
            with pytest.raises(UpstreamError, match="too large|larger"):
                await eng.complete(_req("openai"))
            events, err = await _collect(eng, _req("openai", stream=True))
            return events, err

    events, err = asyncio.run(go())
    assert type(err) is UpstreamError and "too large" in err.message
    assert len([e for e in events if not e.is_reef]) == 1  # the event before the oversized one arrived


def test_non_sse_answer_to_a_stream_is_a_direct_response(fake, api_key):
    app, url = fake
    app.add_faults({"not_sse": True})

    async def go():
        async with UpstreamEngine(url, api_key=api_key) as eng:
            with pytest.raises(DirectResponse) as info:
                async for _ev in eng.stream(_req("openai")):
                    pass
            return info.value.response

    resp = asyncio.run(go())
    assert resp.status == 200 and resp.body["object"] == "chat.completion"


def test_connection_refused_is_an_upstream_error():
    s = socket.socket()  # a port nobody listens on
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()

    async def go():
        async with UpstreamEngine(f"http://127.0.0.1:{port}") as eng:
            await eng.complete(_req("openai"))

    with pytest.raises(UpstreamError, match="connection"):
        asyncio.run(go())


def test_wrong_dialect_is_refused(fake):
    _, url = fake

    async def go():
        async with UpstreamEngine(url, dialect="anthropic") as eng:
            await eng.complete(_req("openai"))

    with pytest.raises(ValidationFailed):
        asyncio.run(go())


def test_closing_a_stream_early_releases_it(fake, api_key):
    app, url = fake
    app.add_faults({"chunk_delay_s": 0.5})  # the whole stream would take ~4 s

    async def go():
        async with UpstreamEngine(url, api_key=api_key) as eng:
            t0 = time.monotonic()
            gen = eng.stream(_req("openai", text="one two three four five six"))
            async for ev in gen:
                if not ev.is_reef:
                    break
            await gen.aclose()  # drops the connection instead of draining the stream
            took = time.monotonic() - t0
            return took, (await eng.complete(_req("openai"))).status

    took, status = asyncio.run(go())
    assert took < 1.0 and status == 200


class _Recorder:
    """A one-thread HTTP server that records each request's head and answers a minimal chat completion."""

    def __init__(self):
        import threading
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.heads: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        import json
        body = json.dumps({"id": "c", "object": "chat.completion", "model": "m", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}).encode()
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, rest = data.split(b"\r\n\r\n", 1)
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                while len(rest) < length:
                    rest += conn.recv(65536)
                self.heads.append(head.decode())
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                             b"content-length: %d\r\n\r\n" % len(body) + body)

    def close(self):
        self.sock.close()


@pytest.mark.parametrize("trust_env", [True, False])
def test_proxy_variables_and_netrc_are_read_at_start(tmp_path, monkeypatch, trust_env):
    # The environment is read once at start (not per request), with aiohttp's trust_env meaning.
    proxy = _Recorder()
    netrc = tmp_path / "netrc"
    netrc.write_text("machine upstream.test login user password secret\n")
    netrc.chmod(0o600)
    for name in ("NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.port}")
    monkeypatch.setenv("NETRC", str(netrc))

    async def go():
        async with UpstreamEngine("http://upstream.test:9/v1", trust_env=trust_env, timeout_s=5,
                                  connect_timeout_s=2) as eng:
            return [await eng.complete(_req("openai")) for _ in range(2)]

    try:
        if not trust_env:  # upstream.test does not resolve: without the proxy the dial fails
            with pytest.raises(UpstreamError):
                asyncio.run(go())
            assert proxy.heads == []
            return
        results = asyncio.run(go())
    finally:
        proxy.close()
    assert [r.body["choices"][0]["message"]["content"] for r in results] == ["hi", "hi"]
    assert len(proxy.heads) == 2
    for head in proxy.heads:
        assert head.startswith("POST http://upstream.test:9/v1/chat/completions HTTP/1.1")
        assert "\r\nAuthorization: Basic dXNlcjpzZWNyZXQ=\r\n" in head  # user:secret from the netrc
