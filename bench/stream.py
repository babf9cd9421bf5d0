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
  count, or ``--threads``), when its thread count differs from the served config's.

The ratio ``reef serve / engine (served config)`` is what the server adds to the engine; the ratio to the ``bench
engine`` row also carries the recipe's thread choice. Also reported: CPU seconds per request of each process (all
threads: barely depends on the machine's load), and the server's per-thread CPU during the streams, read from
``/proc/<pid>/task/<tid>/stat``. ``top -H`` shows the process total on the main thread's row (it reads
``/proc/<pid>/stat`` for the thread whose id is the process id), so there the main thread looks as busy as the engine
thread; the per-thread figures here are the real split. Greedy decoding makes the texts comparable: the server's
stream must carry the text the served engine generates alone.
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
from bench.engine import PROMPT

SCENARIO = "bench-stream"
TARGET = 0.9  # issue #41: one stream through reef serve >= 0.9x the engine alone

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
    """User + system CPU seconds of every thread of ``pid`` (from ``/proc/<pid>/task/<tid>/stat``)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


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


def run(args) -> dict:
    import httpx

    if args.rounds < 1 or args.tokens < 1:
        raise SystemExit("--rounds and --tokens must be at least 1")
    if args.threads is not None and args.threads < 1:
        raise SystemExit("--threads must be at least 1")
    workdir = Path(tempfile.mkdtemp(prefix="reef-bench-stream-"))
    cache = Path(args.cache or os.environ.get("REEF_MODEL_CACHE") or workdir / "models")
    ready.ensure_model(args.model, cache)
    machine = common.machine()
    env = {"REEF_MODEL_CACHE": str(cache)}
    overrides = recipe_overrides(args.model, args.override)
    print(f"model {args.model}, {args.tokens} tokens greedy, {args.rounds} interleaved rounds; logs in {workdir}; "
          f"load avg at start {machine['load_avg_1m_at_start']}", flush=True)
    port = common.free_port()
    url = f"http://127.0.0.1:{port}"
    server = common.Child("reef serve", ready.serve_command(port, workdir / "data", args.model, args.override), url,
                          workdir / "serve.log", env=env,
                          unset=("REEF_TOKEN", "REEF_ADMIN_TOKEN", "REEF_UPSTREAM_URL", "OMP_NUM_THREADS"))
    engines: dict[str, _Engine] = {}
    samples: dict[str, list[dict]] = {}
    server_threads: list[dict] = []
    problems: list[str] = []
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
        with httpx.Client(timeout=args.timeout) as client:
            def through_server() -> dict:
                before, cpu = thread_cpu(server.pid), server.cpu_seconds()
                out = _stream_once(client, url, args.tokens)
                out["cpu_s"] = server.cpu_seconds() - cpu
                out["threads"] = thread_split(server.pid, before, thread_cpu(server.pid))
                return out

            runners = {"reef serve": through_server, **{name: e.once for name, e in engines.items()}}
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
        server.stop()
    server_threads = [s.pop("threads") for s in samples["reef serve"]]
    rows = {name: rates(got) for name, got in samples.items()}
    base = rows["engine (served config)"]["tok_s_median"]
    ratio = rows["reef serve"]["tok_s_median"] / base
    served_threads = threads["engine (served config)"]
    threads["reef serve"] = served_threads
    table = [[name, threads[name], r["tokens"], round(r["tok_s_median"], 1), round(r["tok_s_best"], 1),
              round(r["tok_s_total"], 1), round(r["cpu_s_median"], 2), round(r["tok_s_median"] / base, 2)]
             for name, r in rows.items()]
    print(common.table(["contender", "threads", "tokens", "tok/s median", "tok/s best", "tok/s total",
                        "CPU s/request", "x engine (served)"], table))
    print(f"reef serve / engine alone (served config, {served_threads} thread(s)): x{ratio:.2f} "
          f"(target >= x{TARGET}: {'met' if ratio >= TARGET else 'NOT met'})")
    if "engine (bench engine)" in rows:
        other = rows["engine (bench engine)"]["tok_s_median"]
        print(f"reef serve / `bench engine` row ({threads['engine (bench engine)']} threads): "
              f"x{rows['reef serve']['tok_s_median'] / other:.2f}; the served config's own engine / that row: "
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
    paths = {s.get("path") for name, got in samples.items() if name != "reef serve" for s in got}
    print(f"greedy text identical through the server and alone: {not problems}; engine decode path: "
          f"{', '.join(sorted(p or '?' for p in paths))}; load avg at end {round(os.getloadavg()[0], 2)}")
    for p in problems:
        print(f"PROBLEM: {p}")
    return {"machine": machine, "model": args.model, "tokens": args.tokens, "rounds": args.rounds,
            "threads": threads, "contenders": rows, "ratio_server_vs_engine": ratio, "target": TARGET,
            "server_threads_cpu_s": server_threads, "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
            "samples": {name: [{k: v for k, v in s.items() if k != "text"} for s in got]
                        for name, got in samples.items()},
            "problems": problems}
