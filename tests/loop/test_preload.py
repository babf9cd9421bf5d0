"""``build_deployment(preload=True)`` (``reef serve``) starts the engine's load as soon as the engine exists, and
ends it again when the rest of the deployment cannot be built."""

from __future__ import annotations

import pytest

from reef_core.config import compose_config
from reef_core.engines.upstream import UpstreamEngine
from reef_core.loop.assemble import build_deployment


@pytest.fixture
def calls(monkeypatch):
    seen: list[str] = []

    async def close(self):
        seen.append("close")

    monkeypatch.setattr(UpstreamEngine, "preload", lambda self: seen.append("preload"))
    monkeypatch.setattr(UpstreamEngine, "close", close)
    return seen


def _cfg(tmp_path, *extra):
    return compose_config(["engine.kind=upstream", "engine.upstream_url=http://127.0.0.1:9",
                           f"storage.data_dir={tmp_path}", *extra])


def test_preload_begins_the_engines_load_only_when_asked(tmp_path, calls):
    build_deployment(_cfg(tmp_path / "a")).store.close()
    assert calls == []
    build_deployment(_cfg(tmp_path / "b"), preload=True).store.close()
    assert calls == ["preload"]


def test_a_deployment_that_cannot_be_built_ends_the_load_it_began(tmp_path, calls):
    with pytest.raises(Exception):
        build_deployment(_cfg(tmp_path, "storage.records_url=nosuchdriver://x"), preload=True)
    assert calls == ["preload", "close"]
