"""What ``POST /reef/scenarios/{s}/evaluate`` refuses before the private engine is built: names a scenario does not
have, rows with nothing to load, and surfaces or engine kinds a private engine cannot serve (each a 4xx naming
``release``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from reef_core.errors import Conflict, NotFound
from reef_core.loop.evaluate import Evaluator, resolve

ROWS = [{"release_id": "b" * 40, "current": True, "created_at": "2"},
        {"release_id": "c" * 40, "pending": True, "created_at": "3"},
        {"release_id": "a" * 40, "created_at": "1", "restorable": False},
        {"release_id": "d" * 40, "current": False, "checkpoint": False, "created_at": "4"}]


@pytest.mark.parametrize("value, aliases, expected", [
    ("production", {}, "b" * 40), ("candidate", {}, "c" * 40), ("staging", {"staging": "b" * 40}, "b" * 40),
    ("candidate", {"candidate": "b" * 40}, "b" * 40), ("c" * 40, {}, "c" * 40)])
def test_names_resolve_to_rows(value, aliases, expected):
    assert resolve(value, ROWS, aliases)["release_id"] == expected


@pytest.mark.parametrize("value, rows, error", [
    ("qa", ROWS, NotFound), ("candidate", ROWS[:1], NotFound), ("a" * 40, ROWS, Conflict), ("d" * 40, ROWS, Conflict)])
def test_refused_names(value, rows, error):
    with pytest.raises(error) as caught:
        resolve(value, rows, {})
    assert caught.value.param == "release" and caught.value.message.startswith("release: ")


@pytest.mark.parametrize("kind, engine, word", [("skills", "local", "'skills'"), ("none", "upstream", "'none'"),
                                                ("weights", "upstream", "engine.kind=local"),
                                                ("harness", "sglang", "engine.kind=local or upstream")])
def test_what_the_private_engine_cannot_serve(kind, engine, word):
    evaluator = Evaluator(SimpleNamespace(engine=SimpleNamespace(kind=engine)), None)
    with pytest.raises(Conflict) as caught:
        evaluator.check(kind)
    assert caught.value.param == "release" and word in caught.value.message
