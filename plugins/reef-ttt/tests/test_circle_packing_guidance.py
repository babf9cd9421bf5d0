"""Circle packing n = 26 through Guidance-TTT on CPU (`+ttt_profile=tiny_packing`), driven by the example client:
the archive's best rises strictly above the best seed, never falls, and the picture is written."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
import pytest

from reef_ttt.tasks import circle_packing as cp

pytestmark = pytest.mark.slow

_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "circle_packing.py"
STEPS = 12


def _example():
    spec = importlib.util.spec_from_file_location("reef_ttt_circle_packing_example", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_guidance_ttt_packs_circles_on_cpu(reef_server, tmp_path):
    server = reef_server("+recipe=ttt", "+ttt_profile=tiny_packing", "engine.seed=0", "seed=0")
    png = tmp_path / "packing.png"
    result = _example().run(server.url, "packing-26", STEPS, png=str(png), quiet=True)
    history = result["history"]
    assert len(history) == STEPS and all(b >= a for a, b in zip(history, history[1:]))
    assert result["best"]["score"] > result["seed_best"] == max(cp.verify(s, 26) for s in cp.seeds(26))
    assert cp.verify(result["best"]["state"], 26) == result["best"]["score"]  # re-verified here
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    commits = httpx.get(f"{server.url}/reef/scenarios/packing-26/commits", params={"limit": 100}).json()["commits"]
    trained = [c for c in commits if (c.get("metrics") or {}).get("ttt/step") is not None]
    assert len(trained) == STEPS and all(c["metrics"]["ttt/score_mismatches"] == 0 for c in trained)
