"""Property-based fuzzing of a live ``reef serve`` over every route (hypothesis strategies, raw sockets).

Used by ``tests/test_fuzz.py`` (a short run in the suite) and ``python -m bench fuzz`` (a long one).
Needs ``hypothesis`` (the ``test`` extra).
"""

from .run import FuzzResult, Target, fuzz
from .strategies import Pools, route_strategies
from .target import ADMIN_TOKEN, INFERENCE_TOKEN, prepare, server_overrides

__all__ = ["ADMIN_TOKEN", "INFERENCE_TOKEN", "FuzzResult", "Pools", "Target", "fuzz", "prepare", "route_strategies",
           "server_overrides"]
