"""Shared fixtures. Everything here is real: processes, sockets, SQLite/PostgreSQL, git."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REEF = [sys.executable, "-m", "reef_core.cli"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch):
    # A developer's own tokens or upstream must never leak into a test.
    for var in ("REEF_TOKEN", "REEF_ADMIN_TOKEN", "REEF_UPSTREAM_URL", "REEF_UPSTREAM_API_KEY",
                "REEF_LOAD_PLUGINS", "REEF_DISABLE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    yield
