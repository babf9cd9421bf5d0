"""Start-up: `reef serve +recipe=sao` from process start to ready, then the first chat completions (issue #23).

Each round starts the real command line (``python -m reef_core.cli serve +recipe=sao``) in its own process, on a free
loopback port and a fresh data directory, with the model already converted in the model cache (``--cache``, else
``REEF_MODEL_CACHE``; a missing conversion is made once before the rounds, outside the timings). Each system is
started once before the rounds, untimed, with a kernel cache of its own (:func:`prime`): its rounds find the C kernel
built and the packed weights written, as a user's second start does. It measures:

* ``ready``: process start (just before ``Popen``) to the first 200 from ``GET /healthz`` (polled every 10 ms);
  uvicorn answers only after the application's start-up (engine loaded and warmed up), so this is when requests
  are served; ``ready_cpu``: the server's CPU time (user + system, all threads) at that moment, the work start-up
  took, which a busy machine stretches less than the wall time;
* ``first``: the first chat completion right after ready (short prompt, ``max_tokens`` 1) through the ``openai``
  SDK over loopback, client built before the process starts; then ``first-N``, the next one with ``max_tokens`` N;
* ``idle``: with ``--idle SECONDS`` (default 20; 0: off), the CPU the server uses with no request in flight, as %
  of one core: every process of the server (all threads, and the children they reaped) read from ``/proc`` over
  that window, which begins :data:`IDLE_SETTLE_S` after the last request's answer (the work that answer started, a
  new scenario's learner among it, is not idling).

Targets (issue #41): ready <= 2 s, first request <= 0.2 s after ready, idle <= 0.5% of a core. Medians over rounds
are compared with them (ratio = measured / target: <= 1 meets it). With ``--baseline DIR`` (another checkout, e.g.
before a change) every round starts both, the order alternating, so a busy machine slows them alike; the ratio
this/baseline is the figure to compare across runs.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from bench import common

READY_TARGET_S = 2.0
FIRST_TARGET_S = 0.2
IDLE_TARGET_PCT = 0.5
#: seconds between the last answer and the idle window
IDLE_SETTLE_S = 3.0
SCENARIO = "bench-ready"
PROMPT = [{"role": "user", "content": "What is 2+2?"}]


def add_arguments(parser) -> None:
    parser.add_argument("--rounds", type=int, default=3, help="process starts (default 3)")
    parser.add_argument("--model", default="smollm2", help="engine.model: smollm2 (default), tiny or a directory")
    parser.add_argument("--tokens", type=int, default=16, help="max_tokens of the second request (default 16)")
    parser.add_argument("--cache", default=None, help="model cache directory (default: REEF_MODEL_CACHE, else a "
                                                       "temporary one, converted before the rounds)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a start may take (default 300)")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS of the server (torch's and the bf16 kernel's threads; default: torch's)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="extra `reef serve` override (repeatable)")
    parser.add_argument("--idle", type=float, default=20.0, metavar="SECONDS",
                        help="after the requests, measure the server's CPU with none in flight for this long "
                             "(default 20; 0: off)")
    parser.add_argument("--baseline", default=None, metavar="DIR",
                        help="another Reef checkout (e.g. the main branch's) started in alternating rounds: the "
                             "table shows both and the ratio this/baseline")


def serve_command(port: int, data_dir: Path, model: str, overrides: list[str]) -> list[str]:
    """The README's main command, on ``port`` and ``data_dir``; ``tiny`` takes the recipe's tiny CPU profile."""
    profile = ["+sao_profile=tiny"] if model == "tiny" else [f"engine.model={model}"]
    return [common.PYTHON, "-m", "reef_core.cli", "serve", "+recipe=sao", *profile, f"server.port={port}",
            f"storage.data_dir={data_dir}", "server.log_level=warning", *overrides]


def ensure_model(model: str, cache: Path) -> None:
    """Build or convert the model into ``cache`` once, so that no round pays for it."""
    from reef_core.models.loading import resolve_model

    resolve_model(model, cache, cache)


def _env(cache: Path, threads: int | None, root: Path, kernels: Path) -> dict:
    """The server's environment: the model cache, its own kernel cache (``kernels``), the thread count, and
    ``root``'s code first on the path."""
    env = {"REEF_MODEL_CACHE": str(cache), "REEF_KERNEL_CACHE": str(kernels)}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if root != common.ROOT:  # the same package paths, under the other checkout
        paths = os.environ.get("PYTHONPATH", str(common.ROOT)).split(os.pathsep)
        env["PYTHONPATH"] = os.pathsep.join(p.replace(str(common.ROOT), str(root), 1) for p in paths)
    return env


def _child(workdir: Path, name: str, args, cache: Path, root: Path) -> tuple[common.Child, str]:
    port = common.free_port()
    url = f"http://127.0.0.1:{port}"
    system = name.split("-")[0]
    child = common.Child(name, serve_command(port, workdir / f"data-{name}", args.model, args.override), url,
                         workdir / f"{name}.log", env=_env(cache, args.threads, root, workdir / f"kernels-{system}"),
                         unset=("REEF_TOKEN", "REEF_ADMIN_TOKEN", "REEF_UPSTREAM_URL"), cwd=root)
    return child, url


def prime(workdir: Path, name: str, args, cache: Path, root: Path) -> None:
    """One untimed start of ``root``'s server, so that its rounds find its C kernel built and its packed weights
    written, as a user's second start does. Each system has a kernel cache of its own: two checkouts whose kernel
    sources differ would otherwise overwrite each other's packed weights every round."""
    child, _ = _child(workdir, f"{name}-prime", args, cache, root)
    try:
        child.start(timeout=args.timeout, interval=0.05)
    finally:
        child.stop()


def one_round(workdir: Path, name: str, args, cache: Path, root: Path) -> dict:
    """Start ``root``'s ``reef serve``, wait until ready, send the two requests, stop it."""
    from openai import OpenAI

    child, url = _child(workdir, name, args, cache, root)
    # No retries: a failed first request must show, not be hidden by a second try.
    client = OpenAI(base_url=f"{url}/v1", api_key="unused-on-loopback", max_retries=0, timeout=120)
    out: dict = {}
    started = time.perf_counter()
    child.start(timeout=args.timeout, interval=0.01)
    out["ready_s"] = time.perf_counter() - started
    out["ready_cpu_s"] = child.cpu_seconds()  # the work done to get there: steadier than the wall time on a busy box
    try:
        for key, max_tokens in (("first_s", 1), (f"first_{args.tokens}_s", args.tokens)):
            t = time.perf_counter()
            raw = client.chat.completions.with_raw_response.create(
                model="reef", messages=PROMPT, max_tokens=max_tokens, extra_headers={"x-reef-scenario": SCENARIO})
            out[key] = time.perf_counter() - t
            completion = raw.parse()
            out[key.removesuffix("_s") + "_tokens"] = completion.usage.completion_tokens if completion.usage else None
            if not raw.headers.get("x-reef-agent-record-id"):
                out.setdefault("problems", []).append(f"{name}: {key} answer carries no receipt")
        out["rss_mib"] = round(child.peak_rss_mib() or 0, 1)
        if args.idle:
            out["idle_cpu_pct"] = idle_cpu_pct(child, args.idle)
    finally:
        child.stop()
    return out


def idle_cpu_pct(child: common.Child, seconds: float) -> float:
    """The server's CPU over ``seconds`` with no request in flight, as % of one core (see the module docstring)."""
    time.sleep(IDLE_SETTLE_S)
    cpu, t = common.tree_cpu_seconds(child.pid, reaped=True), time.perf_counter()
    time.sleep(seconds)
    return 100 * (common.tree_cpu_seconds(child.pid, reaped=True) - cpu) / (time.perf_counter() - t)


def summarize(rounds: list[dict], key: str, target: float | None) -> dict:
    values = [r[key] for r in rounds]
    median = statistics.median(values)
    return {"median": round(median, 3), "best": round(min(values), 3), "worst": round(max(values), 3),
            "target": target, "ratio": round(median / target, 2) if target else None,
            "met": median <= target if target else None}


def run(args) -> dict:
    if args.rounds < 1 or args.tokens < 1:
        raise SystemExit("--rounds and --tokens must be at least 1")
    if args.threads is not None and args.threads < 1:
        raise SystemExit("--threads must be at least 1")
    if not args.timeout > 0:
        raise SystemExit("--timeout must be positive")
    if not args.idle >= 0:
        raise SystemExit("--idle must be 0 (off) or a number of seconds")
    systems = {"reef": common.ROOT}
    if args.baseline:
        baseline = Path(args.baseline).resolve()
        if not (baseline / "reef_core" / "cli.py").is_file():
            raise SystemExit(f"--baseline {baseline}: not a Reef checkout (no reef_core/cli.py)")
        systems["baseline"] = baseline
    workdir = Path(tempfile.mkdtemp(prefix="reef-bench-ready-"))
    cache = Path(args.cache or os.environ.get("REEF_MODEL_CACHE") or workdir / "models")
    print(f"model {args.model}, cache {cache}, {args.rounds} rounds of {', '.join(systems)}, logs in {workdir}",
          flush=True)
    t = time.perf_counter()
    ensure_model(args.model, cache)
    result = {"machine": common.machine(), "model": args.model, "cache": str(cache), "threads": args.threads,
              "systems": {name: str(root) for name, root in systems.items()},
              "prepare_model_s": round(time.perf_counter() - t, 2), "rounds": {name: [] for name in systems},
              "problems": []}
    first_n = f"first_{args.tokens}_s"
    for name, root in systems.items():
        prime(workdir, name, args, cache, root)
    for i in range(args.rounds):
        order = list(systems) if i % 2 == 0 else list(reversed(systems))
        for name in order:
            r = one_round(workdir, f"{name}-{i}", args, cache, systems[name])
            result["problems"] += r.pop("problems", [])
            result["rounds"][name].append({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})
            idle = f", idle {r['idle_cpu_pct']:.2f}% of a core" if "idle_cpu_pct" in r else ""
            print(f"round {i} {name}: ready {r['ready_s']:.2f} s ({r['ready_cpu_s']:.2f} s CPU), "
                  f"first {r['first_s']:.3f} s, first-{args.tokens} {r[first_n]:.3f} s{idle}", flush=True)
    result["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    targets = {"ready_s": READY_TARGET_S, "ready_cpu_s": None, "first_s": FIRST_TARGET_S, first_n: None}
    if args.idle:
        targets["idle_cpu_pct"] = IDLE_TARGET_PCT
    result["summary"] = {name: {key: summarize(rounds, key, target) for key, target in targets.items()}
                         for name, rounds in result["rounds"].items()}
    labels = {"ready_s": "ready (process start to /healthz 200), s", "ready_cpu_s": "CPU time (user + system) at "
              "ready, s", "first_s": "first request after ready, 1 token, s",
              first_n: f"next request, {args.tokens} tokens, s",
              "idle_cpu_pct": f"idle CPU ({args.idle:g} s, no request), % of a core"}
    print(f"\nload avg 1 min: {result['machine']['load_avg_1m_at_start']} at start, "
          f"{result['load_avg_1m_at_end']} at end ({result['machine']['cores']} cores)")
    rows = []
    for key in targets:
        for name in systems:
            s = result["summary"][name][key]
            base = result["summary"]["baseline"][key]["median"] if "baseline" in systems else None
            ratio = round(s["median"] / base, 2) if base and name == "reef" else None
            rows.append([labels[key], name, s["median"], s["best"], s["worst"], s["target"], s["ratio"],
                         {True: "yes", False: "NO", None: "-"}[s["met"]], ratio])
    print(common.table(["measure", "system", "median", "best", "worst", "target", "median/target", "met",
                        "x baseline"], rows))
    return result
