"""Authentication: every route but /healthz (and the dashboard's login page) needs a token; admin routes need an
admin token."""

from __future__ import annotations

import re

import anthropic
import httpx
import openai
import pytest

from reef_core.config import compose_config
from reef_core.config.schema import ServerConfig
from reef_core.errors import ConfigError
from reef_core.serve.app import ADMIN, create_app, iter_routes
from reef_core.serve.middleware.auth import EVAL, TokenSet, is_loopback
from reef_core.loop.assemble import build_deployment
from reef_core.serve.process.server import check_bind

INFERENCE, ADMIN_TOKEN = "inference-token-123", "admin-token-456"


@pytest.fixture
def server(reef_server, fake_upstream_url):
    return reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                       f"server.tokens=[{INFERENCE},rotated-token]", f"server.admin_tokens=[{ADMIN_TOKEN}]")


def _routes(tmp_path, fake_upstream_url):
    cfg = compose_config(["engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                          f"storage.data_dir={tmp_path}/routes"])
    app = create_app(build_deployment(cfg))
    try:
        for route in iter_routes(app.routes):
            for method in sorted(route.methods or ()):
                if method == "HEAD":
                    continue
                path = re.sub(r"\{[^}]+\}", "x", route.path)
                # an admin route, or one of a scope a plain token lacks (eval): refused to it, allowed to admin
                yield method, path, getattr(route, "openapi_extra", None) in (ADMIN, EVAL)
    finally:
        app.state.reef.store.close()


def test_every_route_but_healthz_needs_a_token(server, tmp_path, fake_upstream_url):
    routes = list(_routes(tmp_path, fake_upstream_url))
    assert len(routes) >= 8
    for method, path, is_admin in routes:
        response = httpx.request(method, server.url + path, json={})
        if path in ("/healthz", "/ui/login"):
            assert response.status_code in (200, 303), (method, path, response.status_code)  # the login page
            continue
        # A dashboard page sends a browser without a valid token to the login page.
        refused = 303 if path.startswith("/ui") and method == "GET" else 401
        assert response.status_code == refused, (method, path, response.status_code)
        if refused == 303:
            assert response.headers["location"] == "/ui/login"
        wrong = httpx.request(method, server.url + path, json={}, headers={"authorization": "Bearer wrong"})
        assert wrong.status_code == refused, (method, path)
        with_inference = httpx.request(method, server.url + path, json={},
                                       headers={"authorization": f"Bearer {INFERENCE}"})
        if is_admin:
            assert with_inference.status_code == 403, (method, path)
            admin = httpx.request(method, server.url + path, json={},
                                  headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
            assert admin.status_code not in (401, 403), (method, path)
        else:
            assert with_inference.status_code not in (401, 403), (method, path, with_inference.text)


def test_sdks_authenticate_with_bearer_and_x_api_key(server):
    headers = {"x-reef-scenario": "auth"}
    ok = openai.OpenAI(base_url=f"{server.url}/v1", api_key="rotated-token").chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], extra_headers=headers)
    assert ok.choices[0].message.content == "echo: hi"
    ok = anthropic.Anthropic(base_url=server.url, api_key=INFERENCE).messages.create(
        model="m", max_tokens=10, messages=[{"role": "user", "content": "hey"}], extra_headers=headers)
    assert ok.content[0].text == "echo: hey"
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0).messages.create(
            model="m", max_tokens=10, messages=[{"role": "user", "content": "hey"}], extra_headers=headers)
    assert info.value.body["error"]["type"] == "authentication_error"
    assert "Bearer" not in server.log() and INFERENCE not in server.log()


def test_tokens_from_environment(monkeypatch):
    cfg = ServerConfig()
    assert not TokenSet.from_config(cfg).enabled
    monkeypatch.setenv("REEF_TOKEN", "env-token")
    monkeypatch.setenv("REEF_ADMIN_TOKEN", "env-admin")
    tokens = TokenSet.from_config(cfg)
    assert tokens.scope_of("env-token") == "inference"
    assert tokens.scope_of("env-admin") == "admin"
    assert tokens.scope_of("") is None
    monkeypatch.setenv("REEF_TOKEN", "")
    monkeypatch.setenv("REEF_ADMIN_TOKEN", "")
    assert TokenSet.from_config(ServerConfig(tokens=[""])).enabled is False


def test_refuses_non_loopback_bind_without_token():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("")
    with pytest.raises(ConfigError, match="refusing to bind 0.0.0.0"):
        check_bind(compose_config(["server.host=0.0.0.0"]))
    check_bind(compose_config(["server.host=0.0.0.0", "server.tokens=[t]"]))
