"""Request and connection limits of a real `reef serve`: header size and count, header and body read timeouts,
per-route body limits, the connection cap (issue #12, items 7 and 8)."""

from __future__ import annotations

import json
import select
import socket
import statistics
import subprocess
import sys
import time

import httpx
import pytest

from reef_core.testing.fixtures import wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def server(module_reef_server, fake_upstream_url):
    return module_reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                              "server.header_timeout_s=1", "server.body_timeout_s=2", "server.max_connections=400")


def _connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (EOF or reset), without blocking; drains any answer it sent."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        while True:
            chunk = sock.recv(65536, socket.MSG_DONTWAIT)
            if not chunk:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def _answer(sock: socket.socket, timeout: float = 10) -> tuple[int, dict, bytes]:
    """Read one whole response (the server closes the connection after each refusal)."""
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            break
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, body


def _chat_latency(client: httpx.Client, server, n: int) -> list[float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        response = client.post(f"{server.url}/v1/chat/completions", json=CHAT, headers={"x-reef-scenario": "slow"})
        assert response.status_code == 200, response.text
        times.append(time.perf_counter() - started)
    return times


def test_idle_connections_are_closed_after_the_header_timeout(server):
    with httpx.Client(timeout=30) as client:
        before = _chat_latency(client, server, 20)
        idle = []
        for i in range(200):
            sock = _connect(server)
            if i % 2:  # half send a partial request, half nothing at all
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-reef-scen")
            idle.append(sock)
        opened = time.monotonic()
        assert sum(not _closed(sock) for sock in idle) >= 100  # the normal client is measured while they are open
        during = _chat_latency(client, server, 20)
        # Every idle socket is closed soon after the 1 s header timeout (generous bound for a loaded machine).
        wait_until(lambda: all(_closed(sock) for sock in idle), timeout=15, interval=0.2)
        assert time.monotonic() - opened >= 0.9
        after = _chat_latency(client, server, 5)
    for sock in idle:
        sock.close()
    assert statistics.median(during) < 10 * statistics.median(before) + 0.2, (before, during)
    assert after


def test_a_partial_header_gets_408_in_the_dialect(server):
    sock = _connect(server)
    sock.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\n")
    status, headers, body = _answer(sock)
    assert status == 408 and headers["connection"] == "close"
    assert json.loads(body)["type"] == "error"


def test_a_body_that_never_completes_gets_408(server):
    sock = _connect(server)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-reef-scenario: slowbody\r\n"
                 b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"model\"")
    started = time.monotonic()
    status, _, body = _answer(sock, timeout=20)
    assert status == 408 and "error" in json.loads(body)
    assert time.monotonic() - started < 10
    records = httpx.get(f"{server.url}/reef/scenarios").json()
    assert "slowbody" not in json.dumps(records)


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def test_oversized_headers_are_refused_without_growing_memory(server):
    pid = server.proc.pid
    baseline = _rss_kib(pid)
    socks = []
    for _ in range(10):
        sock = _connect(server)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: ")
        try:
            for _ in range(64):  # up to 8 MiB of one unterminated header line
                sock.sendall(b"a" * (128 * 1024))
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused part-way: what this test wants
        socks.append(sock)
    for sock in socks:
        status, headers, _ = _answer(sock)
        assert status == 431 and headers["connection"] == "close"
        sock.close()
    assert _rss_kib(pid) - baseline < 30 * 1024  # the old server grew ~94 MB here
    # Headers and a large body in one segment: only the headers count against the header limit.
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 300_000}]}).encode()
    sock = _connect(server)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-reef-scenario: onesegment\r\n"
                 b"content-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body)
                 + body)
    assert _answer(sock)[0] == 200
    sock.close()
    too_many = {f"x-h{i}": "v" for i in range(150)}
    assert httpx.get(f"{server.url}/healthz", headers=too_many).status_code == 431
    assert httpx.get(f"{server.url}/healthz").status_code == 200


def test_a_body_over_the_inference_limit_is_refused_before_it_is_read(server):
    sock = _connect(server)
    # 8 MiB declared (under the old 64 MiB default, over the 4 MiB one); only 1 KiB ever sent.
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-reef-scenario: big\r\n"
                 b"content-type: application/json\r\ncontent-length: 8388608\r\n\r\n" + b" " * 1024)
    status, headers, body = _answer(sock, timeout=1.5)  # well within the 2 s body timeout
    assert status == 413 and headers["connection"] == "close"
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    # Without a Content-Length (chunked), the read stops at the limit.
    def chunks():
        for _ in range(6):
            yield b" " * (1024 * 1024)
    refused = httpx.post(f"{server.url}/v1/chat/completions", content=chunks(), headers={"x-reef-scenario": "big"})
    assert refused.status_code == 413
    assert "big" not in [s.get("name") for s in httpx.get(f"{server.url}/reef/scenarios").json().get("data", [])]


def _send_all_then_answer(server, head: bytes, body_size: int) -> tuple[int, dict, bytes]:
    """Send a whole request with a ``body_size`` body (the server answers before reading it), then read the
    answer: a server that closes with the body unread resets the connection and the send or the read fails."""
    sock = _connect(server)
    try:
        sock.sendall(head + b"content-length: %d\r\n\r\n" % body_size + b" " * body_size)
        return _answer(sock)
    finally:
        sock.close()


@pytest.mark.parametrize("what, head, size, status", [
    ("a header the parser refuses", b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-odd: a\x01b\r\n", 8 << 20, 400),
    ("a declared body over the limit", b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                                       b"x-reef-scenario: linger\r\ncontent-type: application/json\r\n", 8 << 20, 413),
    ("an answer that leaves the body unread, to a request that asks to close",
     b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n", 8 << 20, 200),
])
def test_an_answer_given_before_the_body_is_read_reaches_a_client_still_sending(server, what, head, size, status):
    for _ in range(3):  # the reset this guards against depends on timing: several rounds
        got, headers, body = _send_all_then_answer(server, head, size)
        assert got == status, (what, body[:300])
        assert headers["connection"] == "close" and json.loads(body)
    assert "linger" not in httpx.get(f"{server.url}/reef/scenarios").text


def test_a_lingering_connection_closes_once_the_answer_is_out(server):
    """After a refusal the server half-closes at once (the answer then EOF), even while the client keeps its end
    open; it stops reading after LINGER_S."""
    from reef_core.serve.middleware.connection import LINGER_S

    sock = _connect(server)
    sock.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-odd: a\x01b\r\ncontent-length: 100000\r\n\r\n")
    started = time.monotonic()
    status, headers, _ = _answer(sock, timeout=5)
    assert status == 400 and time.monotonic() - started < 2  # EOF follows the answer: the read above returned
    sock.sendall(b" " * 1000)  # still read (and dropped) while lingering: no reset
    assert wait_until(lambda: _reset_or_closed(sock), timeout=LINGER_S + 5)
    sock.close()


def _reset_or_closed(sock: socket.socket) -> bool:
    try:
        sock.sendall(b" " * 1000)
    except OSError:
        return True
    return False


def test_report_and_admin_bodies_have_smaller_limits(server):
    report = httpx.post(f"{server.url}/reef/report", headers={"x-reef-scenario": "r"},
                        content=b"{" + b" " * (2 * 1024 * 1024) + b"}")
    assert report.status_code == 413 and report.json()["error"]["code"] == "payload_too_large"
    assert httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, headers={"x-reef-scenario": "adm"}).is_success
    admin = httpx.post(f"{server.url}/reef/scenarios/adm/rollback", content=b"{" + b" " * (128 * 1024) + b"}")
    assert admin.status_code == 413 and admin.json()["error"]["code"] == "payload_too_large"


def test_connections_over_the_cap_get_503(module_reef_server, fake_upstream_url):
    capped = module_reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                                "server.max_connections=5", "server.header_timeout_s=30")
    held = [_connect(capped) for _ in range(5)]
    try:
        extra = _connect(capped)
        status, headers, body = _answer(extra)
        assert status == 503 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "overloaded"
    finally:
        for sock in held:
            sock.close()
    assert wait_until(lambda: _healthy(capped), timeout=10)


def _healthy(server) -> bool:
    try:
        return httpx.get(f"{server.url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_limits_must_be_positive_and_descriptors_are_reserved():
    from reef_core.config.schema import ServerConfig
    from reef_core.errors import ConfigError
    from reef_core.serve.middleware.connection import ConnectionLimits

    assert ConnectionLimits.from_config(ServerConfig(header_timeout_s=0.5)).header_timeout_s == 0.5
    with pytest.raises(ConfigError, match="server.header_timeout_s"):
        ConnectionLimits.from_config(ServerConfig(header_timeout_s=0))
    # With a low soft limit on open files, the server raises it so its connections fit (in a child process).
    script = ("import resource; from reef_core.serve.middleware.connection import reserve_descriptors; "
              "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]; "
              "resource.setrlimit(resource.RLIMIT_NOFILE, (300, hard)); reserve_descriptors(1024); "
              "soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]; "
              "assert soft == (1280 if hard == resource.RLIM_INFINITY else min(1280, hard)), soft")
    subprocess.run([sys.executable, "-c", script], check=True)


def test_a_websocket_upgrade_is_answered_as_plain_http(server):
    """Reef serves no websocket (uvicorn runs with ws="none", so no websocket library loads): a request asking to
    upgrade gets its ordinary HTTP answer and the connection stays HTTP."""
    sock = _connect(server)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\nupgrade: websocket\r\n"
                 b"sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
    sock.shutdown(socket.SHUT_WR)
    status, headers, body = _answer(sock)
    sock.close()
    assert status == 200 and "upgrade" not in headers
    assert json.loads(body)
