"""``reef eval releases`` through the private local engine on hand-made releases of the tiny model: LoRA adapters over
the base, a full-weight release, the base restored after either, the refusals of releases the engine cannot hold,
and harness releases answered by the base. The verifier is a digest of the reply: equal scores, equal replies."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from reef_core.cli import main
from reef_core.commit.git_store import GitArtifactStore
from reef_core.grow.eval_engine import EvalEngine
from reef_core.models.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterWeights
from reef_core.testing.adapters import random_adapter
from reef_core.models.loading import ensure_tiny_model, load_model
from reef_core.surfaces.weights import model_digest
from reef_core.testing.chain import publish

SCENARIO = "w"
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_tiny_model(Path(os.environ["REEF_MODEL_CACHE"]) / "tiny")


def _adapter(base, seed: int) -> AdapterWeights:
    return random_adapter(base, seed)[0]


def _full(base, seed: int) -> dict:
    torch.manual_seed(seed)
    return {k: v + 0.5 * torch.randn_like(v) for k, v in base.state_dict().items() if v.dtype.is_floating_point}


def _files(weights) -> dict:
    if isinstance(weights, AdapterWeights):
        return {ADAPTER_CONFIG: json.dumps(weights.config).encode(),
                ADAPTER_WEIGHTS: save({k: v.contiguous() for k, v in weights.tensors.items()})}
    return {"model.safetensors": save({k: v.contiguous() for k, v in weights.items()})}


def _chain(tmp_path, tiny, *releases) -> list[str]:
    store = GitArtifactStore(tmp_path / "data" / "artifacts.git", tmp_path / "data" / "artifacts-work")
    base = {"base.json": json.dumps({"model": "tiny", "digest": model_digest(tiny)}).encode()}
    ids, head = [], None
    for files in (base, *releases):
        head = publish(store, SCENARIO, files, expected_parent=head, operation="creation" if not ids else "training")
        head = head.release_id
        ids.append(head)
    return ids


def _eval(tmp_path, capsys, *args, surface: str = "weights", model: str = "tiny"):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("What is 2 + 3?", "Name a colour.")))
    code = main(["eval", "releases", "--scenario", SCENARIO, "--tasks", str(tasks), *args, "--no-save",
                 f"storage.data_dir={tmp_path}/data", "engine.kind=local", f"engine.model={model}", "recipe.name=w",
                 f"recipe.surface={surface}", "learn.verifier=python",
                 "+learn.verifier_options.path=reef_core.testing.verifiers:reply_digest"])
    out, err = capsys.readouterr()
    return code, json.loads(out) if out.strip() else None, err


def test_lora_releases_are_loaded_over_the_base_and_scored_alone_the_same(tmp_path, tiny, capsys):
    base = load_model(tiny)[0]
    ids = _chain(tmp_path, tiny, _files(_adapter(base, 1)), _files(_adapter(base, 2)))
    code, doc, err = _eval(tmp_path, capsys)
    assert code == 0, err
    scores = [row["scores"]["tasks"] for row in doc["releases"]]
    assert [row["release_id"] for row in doc["releases"]] == ids
    assert len(set(scores)) == 3  # the base and each adapter answer differently
    for i, release_id in enumerate(ids):
        code, alone, err = _eval(tmp_path, capsys, "--from", release_id, "--to", release_id)
        assert code == 0, err
        assert alone["releases"][0]["scores"]["tasks"] == scores[i]


def test_a_release_whose_weights_do_not_load_is_reported_and_fails_the_run(tmp_path, tiny, capsys):
    base = load_model(tiny)[0]
    ids = _chain(tmp_path, tiny, {"model.safetensors": b"not safetensors"}, _files(_full(base, 3)))
    code, doc, _ = _eval(tmp_path, capsys)
    assert code == 1
    broken, full = doc["releases"][1], doc["releases"][2]
    assert broken["release_id"] == ids[1] and "its weights do not load" in broken["error"]
    assert broken["scores"] == {"tasks": None}
    assert full["error"] is None and full["scores"]["tasks"] != doc["releases"][0]["scores"]["tasks"]


@pytest.mark.parametrize("files, message", [
    ({"base.json": json.dumps({"model": "other", "digest": "sha256:00"}).encode()}, "names base model 'other'"),
    ({"notes.txt": b"hello"}, "holds no weights"),
])
def test_releases_the_engine_cannot_hold_are_refused_before_it_loads(tmp_path, tiny, capsys, files, message):
    store = GitArtifactStore(tmp_path / "data" / "artifacts.git", tmp_path / "data" / "artifacts-work")
    publish(store, SCENARIO, files, expected_parent=None)
    code, doc, err = _eval(tmp_path, capsys)
    assert code == 2 and doc is None and message in err and len(err.strip().splitlines()) == 1


def test_restore_base_puts_back_what_a_full_swap_moved_and_leaves_an_adapter_line(tiny):
    base = load_model(tiny)[0]
    engine = EvalEngine(tiny, device="cpu")
    state = base.state_dict()
    try:
        reply = engine.generate(("base",), lambda e: engine.restore_base(e, lambda: state), MESSAGES)
        moved = engine.generate("full", lambda e: engine.swap(e, _full(base, 4)), MESSAGES)
        assert moved != reply
        assert engine.generate(("base",), lambda e: engine.restore_base(e, lambda: state), MESSAGES) == reply
        lora = engine.generate("lora", lambda e: engine.swap(e, _adapter(base, 5)), MESSAGES)
        assert lora != reply

        def no_full_swap():  # after adapters the engine's own weights are the base: nothing to swap back
            raise AssertionError("the base was swapped in again")

        assert engine.generate(("base",), lambda e: engine.restore_base(e, no_full_swap), MESSAGES) == reply
    finally:
        engine.close()


def test_harness_releases_are_answered_by_the_base_with_their_system_prompt(tmp_path, tiny, capsys):
    # The tiny model's own greedy replies are blank lines whatever the prompt; noisy weights make them depend on it.
    noisy = tmp_path / "noisy"
    shutil.copytree(tiny, noisy)
    model = load_model(tiny)[0]
    model.load_state_dict(_full(model, 4))
    model.save_pretrained(noisy)
    store = GitArtifactStore(tmp_path / "data" / "artifacts.git", tmp_path / "data" / "artifacts-work")
    head, ids = None, []
    for prompt in ("You answer in French.", "Reply with one word.", "You answer in French."):
        head = publish(store, SCENARIO, {"system_prompt.md": prompt.encode()}, expected_parent=head).release_id
        ids.append(head)
    code, doc, err = _eval(tmp_path, capsys, surface="harness", model=str(noisy))
    assert code == 0, err
    first, second, third = (row["scores"]["tasks"] for row in doc["releases"])
    assert first != second and third == first  # the same prompt again answers the same (greedy)
    assert doc["releases"][2]["same_content_as"] == ids[0]
