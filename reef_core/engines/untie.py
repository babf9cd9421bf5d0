"""The base model as vLLM must serve it for full-weight releases: output embeddings untied.

vLLM 0.32 reloads weights in place layer by layer (``model_executor/model_loader/reload``). A model that ties its
output head to its input embeddings (SmolLM2, Qwen2 0.5B, the tiny test model) loads no ``lm_head`` weights, so the
reload puts the head's old tensors back ("ParallelLMHead: Failed to load weights" in the server's log) and, on the
CPU, the head keeps its old packed matrix: every release that moves the embeddings is then served with the base
model's head, silently. Served from a copy whose config unties the head and whose files hold it explicitly, the head
is a layer of its own that every reload loads.

The copy changes nothing Reef trains: the trainer keeps ``engine.model`` (tied), and each release written over the
copy gives the head the embeddings' values (:func:`tie_in_release`). Run ``python -m reef_core.engines.untie
<model dir> <copy dir>`` to make the copy for a server you start yourself; ``engine.launch`` serves it by itself.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from reef_core.engines.staging import check_readable, staged_dir

#: Written into the copy: which head key mirrors which embedding key.
MARKER = "reef_untied.json"


def ties_embeddings(model_dir: Path) -> bool:
    """Whether the HF model in ``model_dir`` ties its output head to its input embeddings."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", True)))


def untied_copy(model_dir: Path, target: Path) -> Path:
    """Write (once) an untied copy of ``model_dir`` at ``target`` and return it (see the module docstring)."""
    from safetensors.torch import load_file, save_file

    model_dir, target = Path(model_dir).absolute(), Path(target).absolute()
    if (target / MARKER).is_file() and json.loads((target / MARKER).read_text()).get("source") == str(model_dir):
        return target
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} holds no safetensors weights")
    tensors: dict = {}
    for f in files:
        tensors.update(load_file(str(f)))
    embed = next((k for k in tensors if k.endswith("embed_tokens.weight")), None)
    if embed is None:
        raise ValueError(f"{model_dir}: no embed_tokens weight to untie the output head from")
    head = "lm_head.weight"
    tensors[head] = tensors[embed].clone()
    with staged_dir(target) as tmp:
        for f in model_dir.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
                shutil.copy2(f, tmp / f.name)
        config = json.loads((model_dir / "config.json").read_text())
        config["tie_word_embeddings"] = False
        if isinstance(config.get("text_config"), dict):
            config["text_config"]["tie_word_embeddings"] = False
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        check_readable(tmp / "model.safetensors", {k: tuple(v.shape) for k, v in tensors.items()})
        (tmp / MARKER).write_text(json.dumps({"source": str(model_dir), "head": head, "embed": embed}))
    return target


def tie_in_release(directory: Path, tensors: dict) -> None:
    """Give a release written over an untied copy the tie the trained model has: head = embeddings."""
    try:
        marker = json.loads((Path(directory) / MARKER).read_text())
    except (OSError, ValueError):
        return
    if marker.get("embed") in tensors:
        tensors[marker["head"]] = tensors[marker["embed"]].clone()  # safetensors refuses shared storage


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m reef_core.engines.untie <model dir> <copy dir>", file=sys.stderr)
        return 2
    if not ties_embeddings(Path(args[0])):
        print(f"{args[0]} does not tie its embeddings: serve it as it is")
        return 0
    print(untied_copy(Path(args[0]), Path(args[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
