"""Fixtures of the learner tests."""

from __future__ import annotations

import pytest

from reef_core import hookimpl
from reef_core.config import compose_config
from reef_core.loop.assemble import build_deployment
from reef_core.plugins import PluginManager
from reef_core.serve.app import create_app
from reef_core.testing.fake_upstream import serve_asgi


@pytest.fixture
def serve_trainer(tmp_path, fake_upstream_url):
    """``serve_trainer(name, make_trainer, *overrides, plugins=())``: an in-process Reef on the fake provider, its
    data in the test's tmp_path, whose recipe trains with ``make_trainer()`` registered as trainer ``name`` (further
    test components come from ``plugins``); a context manager yielding the base URL (call it again to restart on the
    same data)."""

    def serve(name: str, make_trainer, *overrides: str, plugins=()):
        class TrainerPlugin:
            @staticmethod
            @hookimpl
            def reef_register_trainers(register):
                register(name, lambda **_: make_trainer())

        pm = PluginManager(extra_plugins=(TrainerPlugin, *plugins))
        cfg = compose_config(["engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                              f"storage.data_dir={tmp_path}", *overrides, f"recipe.trainer={name}"], pm)
        return serve_asgi(create_app(build_deployment(cfg, pm)), lifespan="on")

    return serve
