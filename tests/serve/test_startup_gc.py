"""``reef serve`` keeps the cyclic garbage collector off during start-up (its passes over the millions of objects
imports and the model create cost ~15% of start-up's CPU, issue #41) and turns it on when start-up's objects are
frozen (serve/process/server.py: freeze_startup_objects); a composition in this process has its cycles collected
right after it, the rest of start-up is frozen without a full pass (0.2 s of the main thread with the model
loaded)."""

from __future__ import annotations

import argparse
import gc
import weakref

import pytest

from reef_core import cli
from reef_core.serve.process import server


class _Node:
    me = None


@pytest.fixture
def restore_gc():
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


def test_start_up_runs_without_the_collector_and_collects_an_in_process_composition(monkeypatch, restore_gc):
    """Where ``reef serve`` cannot compose in a child process (threads running), it composes here and collects the
    composition's cycles before the rest of start-up (tests/test_config_apart.py: the forked path)."""
    seen = []
    composed = []

    def compose(overrides):
        cycle = _Node()
        cycle.me = cycle  # what the composition leaves behind (OmegaConf nodes refer to their parents)
        composed.append(weakref.ref(cycle))
        return argparse.Namespace(server=argparse.Namespace(learner=False))

    monkeypatch.setattr("reef_core.config.apart.can_fork", lambda: False)
    monkeypatch.setattr("reef_core.config.compose.compose_config", compose)
    monkeypatch.setattr(server, "serve", lambda cfg: seen.append((gc.isenabled(), composed[0]() is None)) or 0)
    assert cli.cmd_serve(argparse.Namespace(overrides=[])) == 0
    assert seen == [(False, True)]


def test_freezing_start_up_objects_turns_the_collector_on(restore_gc):
    gc.disable()
    cycle = _Node()
    cycle.me = cycle  # a cycle start-up left behind: collected, not frozen for the process's life
    gone = weakref.ref(cycle)
    del cycle
    server.freeze_startup_objects()
    assert gone() is None
    assert gc.isenabled() and gc.get_freeze_count() > 0
    frozen = gc.get_freeze_count()
    server.freeze_startup_objects()  # again (once uvicorn listens): only what was built since
    assert gc.isenabled() and gc.get_freeze_count() >= frozen


def test_freezing_without_collecting_keeps_what_is_there(restore_gc):
    gc.disable()
    cycle = _Node()
    cycle.me = cycle
    kept = weakref.ref(cycle)
    del cycle
    server.freeze_startup_objects(collect=False)
    gc.collect()  # a frozen cycle is out of the collector's sight
    assert kept() is not None and gc.isenabled()
