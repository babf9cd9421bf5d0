"""Concurrent clients on the embedded engine: tokens/s of 1 client vs N concurrent clients (continuous batching).

One :class:`LocalEngine` (``engine.max_batch_size`` = N), N different requests (prompts, seeds, temperatures), the
same token budget. ``1 client``: the N requests one after another; ``N clients``: the N requests at once. Rounds
alternate the two, so a busy shared machine slows both alike. tokens/s = generated tokens / wall time (prefill
included). The same requests are compared for sameness: with the same seed a batched request must sample the same
tokens as alone and its log-probs must agree (the printed max difference; the tests hold it to 1e-4 of the trainer's
recomputation).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench import common

TOPICS = ["a lighthouse keeper", "the sea", "a mountain village", "a robot learning to paint", "an old library",
          "a desert caravan", "a winter forest", "a city at night", "a ship's cat", "a clockmaker"]


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="tiny", help="tiny, smollm2 or a model directory (default tiny)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request (default 64)")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent clients (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (1 client, N clients) (default 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--cache", default=None, help="model cache directory (default: REEF_MODEL_CACHE or a "
                                                       "temporary one)")


def _bodies(n: int, tokens: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"Tell me a long story about {TOPICS[i % len(TOPICS)]}."}],
             "max_tokens": tokens, "temperature": [1.0, 0.7][i % 2], "seed": 100 + i} for i in range(n)]


def _measure(model_dir: Path, args) -> dict:
    import torch

    from reef_core.engines.base import EngineRequest
    from reef_core.engines.local import LocalEngine

    threads = args.threads or torch.get_num_threads()
    bodies = _bodies(args.concurrency, args.tokens)
    loop = asyncio.new_event_loop()
    engine = LocalEngine(model_dir, max_new_tokens=args.tokens, num_threads=threads,
                         max_batch_size=args.concurrency)
    loop.run_until_complete(engine.start())

    def req(body):
        return EngineRequest("openai", "chat", dict(body, model="m"), {})

    async def one_client():
        return [await engine.complete(req(b)) for b in bodies]

    async def n_clients():
        return await asyncio.gather(*(engine.complete(req(b)) for b in bodies))

    def timed(fn):
        t = time.perf_counter()
        out = loop.run_until_complete(fn())
        return out, time.perf_counter() - t

    try:
        timed(n_clients)  # warm-up: allocator, kernel threads
        rates: dict[str, list[float]] = {"1 client": [], f"{args.concurrency} clients": []}
        same, max_diff, tokens = True, 0.0, 0
        for r in range(args.rounds):
            order = [("1 client", one_client), (f"{args.concurrency} clients", n_clients)]
            results = {}
            for name, fn in (order if r % 2 == 0 else order[::-1]):
                out, s = timed(fn)
                n = sum(len(x.tokens.output_ids) for x in out)
                rates[name].append(n / s)
                print(f"  round {r + 1}: {name}: {n} tokens in {s:.1f} s = {n / s:.1f} tok/s", flush=True)
                results[name] = out
                tokens = n
            for a, b in zip(*results.values()):
                same = same and a.tokens.output_ids == b.tokens.output_ids
                if a.tokens.output_ids == b.tokens.output_ids:
                    diffs = [abs(x - y) for x, y in zip(a.tokens.output_logprobs, b.tokens.output_logprobs)]
                    max_diff = max([max_diff, *diffs])
        max_rows = engine.stats["max_rows"]
    finally:
        loop.run_until_complete(engine.close())
        loop.close()
    from reef_core.engines import kernels

    return {"threads": threads, "tokens_per_round": tokens, "rates": rates, "same_tokens": same,
            "max_logprob_diff": max_diff, "max_rows": max_rows, "kernel": kernels.isa() or "none (torch)"}


def run(args) -> dict:
    from reef_core.models.loading import resolve_model

    machine = common.machine()
    cache = Path(args.cache or os.environ.get("REEF_MODEL_CACHE") or tempfile.mkdtemp(prefix="reef-bench-batch-"))
    model_dir = resolve_model(args.model, cache, cache)
    result = _measure(model_dir, args)
    rates = result["rates"]
    one = statistics.median(rates["1 client"])
    rows = [[name, round(statistics.median(v), 1), round(max(v), 1), round(statistics.median(v) / one, 2)]
            for name, v in rates.items()]
    print(f"Embedded engine, {args.model}, {args.concurrency} requests x {args.tokens} tokens, {args.rounds} "
          f"alternating rounds, {result['threads']} thread(s), bf16 products on {result['kernel']} (REEF_AMX=0: "
          f"AVX-512); load avg at start {machine['load_avg_1m_at_start']}")
    print(common.table(["clients", "tok/s median", "tok/s best", "x 1 client"], rows))
    print(f"most rows in one decode step: {result['max_rows']}; batched = alone (same seeds): tokens "
          f"{'identical' if result['same_tokens'] else 'DIFFER'}, max |log-prob difference| "
          f"{result['max_logprob_diff']:.2e}")
    problems = [] if result["same_tokens"] and result["max_logprob_diff"] <= 1e-4 else [
        "batched requests differ from the same requests alone"]
    return {"machine": machine, "model": args.model, "tokens": args.tokens, "concurrency": args.concurrency,
            **result, "ratio": statistics.median(rates[f"{args.concurrency} clients"]) / one, "problems": problems}
