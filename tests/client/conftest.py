"""A live ``reef serve`` whose harness releases follow reports (``FeedbackTreeTrainer``), shared per module."""

from __future__ import annotations

import pytest

TOKEN = "client-token-1"
HARNESS_RECIPE = ("recipe.surface=harness", "recipe.processor=per_report", "+recipe.processor_options.batch_size=1",
                  "recipe.trainer=reef_core.testing.trainers:FeedbackTreeTrainer")


@pytest.fixture(scope="module")
def live_reef(module_reef_server, fake_upstream_url):
    server = module_reef_server("engine.kind=upstream", f"engine.upstream_url={fake_upstream_url}",
                                f"server.tokens=[{TOKEN}]", *HARNESS_RECIPE)
    server.token = TOKEN
    return server
