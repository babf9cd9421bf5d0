"""Test support shipped with reef-core: fakes for CPU tests and benchmarks (never used in production).

Names are resolved lazily so that ``python -m reef_core.testing.fake_upstream`` does not import the
module twice.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["FakeUpstream", "FakeUpstreamControl", "serve_fake_upstream", "run_fake_upstream", "serve_asgi"]

if TYPE_CHECKING:
    from reef_core.testing.fake_upstream import (  # noqa: F401
        FakeUpstream,
        FakeUpstreamControl,
        run_fake_upstream,
        serve_asgi,
        serve_fake_upstream,
    )


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("reef_core.testing.fake_upstream"), name)
    raise AttributeError(name)
