"""``GET /reef/scenarios/{s}/releases/compare`` over real HTTP: counts, means and a reproducible bootstrap interval
of b - a from the reports of the records each release served, and the refusals at the door."""

from __future__ import annotations

from urllib.parse import quote

import httpx
import pytest

from reef_core.testing.release_loop import ADMIN, ROUNDS, TOKEN, release_loop


@pytest.fixture(scope="module")
def loop(tmp_path_factory, fake_upstream_url):
    with release_loop(tmp_path_factory.mktemp("cmp") / "data", fake_upstream_url) as found:
        yield found


def _get(loop, path: str, token: str = TOKEN, **params) -> httpx.Response:
    return httpx.get(f"{loop.url}/reef/scenarios/{quote(loop.scenario, safe='')}{path}", params=params,
                     headers={"authorization": f"Bearer {token}"}, timeout=30)


def test_compare_two_releases(loop):
    first, second = loop.served
    answer = _get(loop, "/releases/compare", a=first, b=second)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["a"] == {"release_id": first, "scored": 4, "mean": 0.25}
    assert body["b"] == {"release_id": second, "scored": 4, "mean": 0.75}
    diff = body["difference"]
    assert diff["mean"] == pytest.approx(0.5)
    assert diff["replicates"] == 2000 and diff["confidence"] == 0.95
    # Resamples of 4 scores each: b - a lies in [-1, 1], and the 95% interval holds the observed difference
    # without being the whole range (a side always all-equal would give a zero-width one).
    assert -1 <= diff["low"] < 0.5 < diff["high"] <= 1
    assert _get(loop, "/releases/compare", a=first, b=second).json() == body  # a fixed seed: the same answer
    swapped = _get(loop, "/releases/compare", a=second, b=first).json()["difference"]
    assert swapped["mean"] == pytest.approx(-0.5)
    # The head served nothing scored yet: a count of 0 and no interval, not an error.
    empty = _get(loop, "/releases/compare", a=first, b=loop.head).json()
    assert empty["b"]["scored"] == 0 and empty["b"]["mean"] is None and empty["difference"]["low"] is None
    assert len(ROUNDS) == 2


@pytest.mark.parametrize("params, status, field", [
    ({"b": "x"}, 400, "a"),
    ({"a": "x"}, 400, "b"),
    ({"a": "", "b": "x"}, 400, "a"),
    ({"a": "0" * 40, "b": "FIRST"}, 404, "a"),
    ({"a": "FIRST", "b": "nope\u2028"}, 404, "b"),
    ({"a": "FIRST", "b": "x" * 201}, 400, "b"),
])
def test_refusals_name_the_field(loop, params, status, field):
    params = {k: loop.served[0] if v == "FIRST" else v for k, v in params.items()}
    answer = _get(loop, "/releases/compare", **params)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"code", "message"} and error["message"].startswith(f"{field}:")


def test_unknown_scenario_and_tokens(loop):
    answer = httpx.get(f"{loop.url}/reef/scenarios/nope/releases/compare", params={"a": "x", "b": "y"},
                       headers={"authorization": f"Bearer {ADMIN}"})
    assert answer.status_code == 404 and "nope" in answer.json()["error"]["message"]
    assert _get(loop, "/releases/compare", token="wrong", a="x", b="y").status_code == 401
