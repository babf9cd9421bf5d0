"""Time a training step and a weight publish of the embedded engine on CUDA with a real-size random-init model.

Builds a random-init Qwen2-architecture model of the chosen size (weights only: the tiny test tokenizer, so no
download), then runs ``python -m bench publish`` on it twice (full weights, then LoRA) with ``engine.device`` set,
and prints one table: training-step time and publish latency (selected to served) per mode. Used by
``scripts/gpu_check.sh``; ``--device cpu --size small`` checks the script itself on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: name -> (hidden, layers, heads, kv heads, intermediate); "0.5b" has the shape of Qwen2.5-0.5B's blocks.
SIZES = {"small": (128, 2, 4, 2, 256), "0.5b": (896, 24, 14, 2, 4864), "1.5b": (1536, 28, 12, 2, 8960)}


def build_model(directory: Path, size: str) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from reef_core.models.loading import CHAT_TEMPLATE, build_tiny_tokenizer, save_tokenizer

    hidden, layers, heads, kv, inter = SIZES[size]
    tok = build_tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(directory)
    save_tokenizer(tok, directory, "Qwen2Tokenizer")
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {size}, {params / 1e6:.0f} M parameters, in {directory}", flush=True)
    return directory


def run_bench(model_dir: Path, device: str, lora: bool, versions: int) -> dict:
    cmd = [sys.executable, "-m", "bench", "publish", "--model-dir", str(model_dir), "--device", device,
           "--versions", str(versions), "--timeout", "900"] + (["--lora"] if lora else [])
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=False)
    return json.loads((ROOT / "bench" / "results" / "publish.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--versions", type=int, default=4)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="reef-gpu-check-") as tmp:
        model_dir = build_model(Path(tmp) / f"random-{args.size}", args.size)
        for lora in (False, True):
            result = run_bench(model_dir, args.device, lora, args.versions)
            s = result["summary"]
            rows.append(("lora" if lora else "full weights", s["train_step_ms"].get("p50"),
                         s["live_publish_ms"].get("p50"), s["durable_publish_ms"].get("p50"),
                         "; ".join(result.get("problems") or []) or "ok"))
    print(f"\nembedded engine + trainer on {args.device}, random-init {args.size} model")
    header = ("mode", "train step p50 ms", "live publish p50 ms", "durable publish p50 ms", "problems")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for line in (header, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths)))
    return 0 if all(r[-1] == "ok" for r in rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    sys.exit(main())
