"""Shared fixtures: a FakeUpstream served in a background thread, and the tiny local model."""

from __future__ import annotations

import pytest

from reef_core.testing import FakeUpstream, serve_asgi

API_KEY = "sk-test-upstream"


@pytest.fixture(scope="module")
def fake_app():
    return FakeUpstream(api_key=API_KEY)


@pytest.fixture(scope="module")
def fake_server(fake_app):
    with serve_asgi(fake_app) as url:
        yield url


@pytest.fixture
def fake(fake_app, fake_server):
    """(app, url) with faults and counters reset for each test."""
    fake_app.reset()
    yield fake_app, fake_server
    fake_app.reset()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from reef_core.grow.models import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")



@pytest.fixture
def api_key():
    return API_KEY
