"""Learning where a user sees it: ``reef serve +recipe=sao`` (SmolLM2-135M) driven by the SAO example client.

The README's default deployment, started as a child process (``python -m reef_core.cli serve +recipe=sao``, a
temporary data directory, a free port, ``REEF_MODEL_CACHE``), and ``plugins/reef-sao/examples/client.py`` run
against it for a wall-clock budget (``--minutes``, default 15) with ``--concurrency`` clients (the embedded engine
decodes concurrent requests as one batch). Each client sends a task, scores the reply with the task's verifier
and reports the score on its receipt; the learner trains on the reports and publishes new weights while serving
continues.

It prints the reward curve (mean per window of ``--window`` rollouts, in report order, with the wall time of the
window's last report and the training releases published by then), the first-window vs last-window difference
against the +0.1 target of issue #23, the training-step times from the commits route, publish latencies from the
releases route, and the machine's 1-minute load at start and end. ``--model tiny`` runs the tiny CPU profile
(``+sao_profile=tiny``) for a quick check; positional Hydra overrides go to ``reef serve`` after the profile.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from bench import common
from bench.publish import _get_json

TARGET_GAIN = 0.1
SCENARIO = "sao-vowels"
CLIENT = common.ROOT / "plugins" / "reef-sao" / "examples" / "client.py"
#: Training releases are polled this often to place each window on the release timeline.
POLL_S = 2.0
#: Printed tables keep at most this many rows (evenly spaced, first and last kept); the JSON has them all.
MAX_ROWS = 30


def add_arguments(parser) -> None:
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2",
                        help="smollm2 (the README's `reef serve +recipe=sao`) or tiny (`+sao_profile=tiny`, a quick "
                             "check)")
    parser.add_argument("--minutes", type=float, default=15.0,
                        help="client budget in minutes, from the server being ready; tasks already sent then finish "
                             "(default 15)")
    parser.add_argument("--concurrency", type=int, default=8,
                        help="concurrent example clients (default 8 = engine.max_batch_size's default)")
    parser.add_argument("--window", type=int, default=None,
                        help="rollouts per window of the curve (default: 16 = two client rounds of 8 for smollm2, "
                             "48 for tiny)")
    parser.add_argument("--max-tokens", type=int, default=None, help="max_tokens per request (default: the SAO task's, 24)")
    parser.add_argument("--seed", type=int, default=0, help="task stream, engine and trainer seed (default 0)")
    parser.add_argument("--cache", default=None,
                        help="model cache directory (default: REEF_MODEL_CACHE or one in the temporary data dir)")
    parser.add_argument("--log", default=None, help="copy the server's log to this file at the end")
    parser.add_argument("--ready-timeout", type=float, default=900,
                        help="seconds to wait for the server to become healthy (default 900: a first SmolLM2 "
                             "conversion)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for `reef serve` (e.g. trainer.lr=1e-5)")


def _load_client():
    spec = importlib.util.spec_from_file_location("reef_sao_example_client", CLIENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(args) -> None:
    if args.minutes <= 0:
        raise SystemExit("--minutes must be > 0")
    if args.concurrency < 1:
        raise SystemExit("--concurrency must be >= 1")
    if args.window is not None and args.window < 1:
        raise SystemExit("--window must be >= 1")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise SystemExit("--max-tokens must be >= 1")


class _ReleasePoller(threading.Thread):
    """Polls the releases route; ``timeline`` lists (seconds since ``t0``, training releases seen so far)."""

    def __init__(self, base: str, t0: float):
        super().__init__(daemon=True)
        self.base, self.t0 = base, t0
        self.seen: set[str] = set()
        self.timeline: list[tuple[float, int]] = [(0.0, 0)]
        self.errors = 0
        self.halt = threading.Event()

    def poll(self) -> None:
        try:
            rows = _get_json(self.base, f"/reef/scenarios/{SCENARIO}/releases").get("releases", [])
        except Exception:  # noqa: BLE001 - a slow route on a busy machine: try again next time
            self.errors += 1
            return
        # Union over polls: a live (in-memory) version is listed only while it serves.
        self.seen.update(r["release_id"] for r in rows if r.get("operation") == "training")
        self.timeline.append((time.monotonic() - self.t0, len(self.seen)))

    def run(self) -> None:
        while not self.halt.wait(POLL_S):
            self.poll()

    def released_by(self, t: float) -> int:
        return max((n for at, n in self.timeline if at <= t), default=0)


def _commits(base: str, scenario: str = SCENARIO) -> list[dict]:
    rows, after = [], 0
    while True:
        page = _get_json(base, f"/reef/scenarios/{scenario}/commits?after_step={after}&limit=100")
        rows += page.get("commits", [])
        after = page.get("next_after_step")
        if after is None:
            return rows


def windows(rewards: list[float], times: list[float], size: int) -> list[dict]:
    """Consecutive windows of ``size`` rollouts (the last may be shorter): mean, count, end time."""
    out = []
    for start in range(0, len(rewards), size):
        chunk = rewards[start:start + size]
        out.append({"first": start + 1, "count": len(chunk), "mean": round(statistics.mean(chunk), 4),
                    "end_s": times[start + len(chunk) - 1]})
    return out


def gain(rewards: list[float], size: int) -> dict:
    """Mean of the last ``size`` rollouts minus the mean of the first ``size`` (the example client's figure)."""
    w = min(size, len(rewards))
    if not w:
        return {}
    first, last = statistics.mean(rewards[:w]), statistics.mean(rewards[-w:])
    return {"window": w, "first": round(first, 4), "last": round(last, 4), "gain": round(last - first, 4),
            "overlap": 2 * w > len(rewards), "target": TARGET_GAIN, "met": last - first >= TARGET_GAIN}


def thin(rows: list, limit: int = MAX_ROWS) -> list:
    """At most ``limit`` of ``rows``, evenly spaced, always the first and the last."""
    if len(rows) <= limit:
        return rows
    picks = sorted({round(i * (len(rows) - 1) / (limit - 1)) for i in range(limit)})
    return [rows[i] for i in picks]


def run(args) -> dict:
    _check(args)
    client = _load_client()
    window = args.window or (48 if args.model == "tiny" else 16)
    machine = common.machine()
    workdir = Path(tempfile.mkdtemp(prefix="reef-bench-learn-"))
    cache = args.cache or os.environ.get("REEF_MODEL_CACHE") or str(workdir / "models")
    port = common.free_port()
    profile = ["+sao_profile=tiny"] if args.model == "tiny" else []
    cmd = [common.PYTHON, "-m", "reef_core.cli", "serve", "+recipe=sao", *profile, f"seed={args.seed}",
           f"engine.seed={args.seed}", f"server.port={port}", f"storage.data_dir={workdir / 'data'}",
           "server.log_level=warning", *args.overrides]
    reef = common.Child("reef", cmd, f"http://127.0.0.1:{port}", workdir / "reef.log",
                        env={"REEF_TOKEN": common.TOKEN, "REEF_MODEL_CACHE": cache}, unset=("REEF_ADMIN_TOKEN",))
    began = time.monotonic()
    poller = None
    try:
        reef.start(timeout=args.ready_timeout)
        ready_s = round(time.monotonic() - began, 1)
        print(f"reef serve +recipe=sao{' +sao_profile=tiny' if profile else ''} ready in {ready_s} s "
              f"(load {os.getloadavg()[0]:.2f}); {args.concurrency} client(s) for {args.minutes:g} min", flush=True)
        t0 = time.monotonic()
        poller = _ReleasePoller(reef.url, t0)
        poller.start()
        result = client.run(reef.url, SCENARIO, None, seed=args.seed, token=common.TOKEN,
                            max_tokens=args.max_tokens, window=window, concurrency=args.concurrency,
                            duration_s=args.minutes * 60)
        client_s = round(time.monotonic() - t0, 1)
        poller.halt.set()
        poller.join(30)
        poller.poll()
        releases = result["releases"]
        commits = _commits(reef.url)
        rss = reef.peak_rss_mib()
        load_end = round(os.getloadavg()[0], 2)
    except Exception as exc:
        raise RuntimeError(f"{exc}\n--- reef log tail ---\n{reef.log_tail()}") from exc
    finally:
        if poller is not None:
            poller.halt.set()
        reef.stop()
        log_tail = reef.log_tail()
        if args.log and reef.log_path.exists():
            shutil.copyfile(reef.log_path, args.log)
        shutil.rmtree(workdir, ignore_errors=True)

    rewards, times = result["rewards"], result["times"]
    curve = windows(rewards, times, window)
    for row in curve:
        row["releases"] = poller.released_by(row["end_s"])
    print(f"\nmodel {args.model}, window {window} rollouts, {len(rewards)} rollouts in {client_s} s"
          + (f" ({MAX_ROWS} of {len(curve)} windows shown)" if len(curve) > MAX_ROWS else ""))
    print(common.table(["rollouts", "n", "mean reward", "wall s", "releases"],
                       [[f"{r['first']}-{r['first'] + r['count'] - 1}", r["count"], r["mean"], r["end_s"],
                         r["releases"]] for r in thin(curve)]))
    summary = gain(rewards, window)
    if summary:
        print(f"first {summary['window']}: {summary['first']:.3f}, last {summary['window']}: {summary['last']:.3f}, "
              f"gain {summary['gain']:+.3f} (target >= +{TARGET_GAIN}: {'met' if summary['met'] else 'not met'})"
              + (" [windows overlap: too few rollouts]" if summary["overlap"] else ""))
    steps = [{"step": c.get("step"), "train_s": c["metrics"]["train_s"],
              "batch_size": c["metrics"].get("batch_size"),
              "decision": (c.get("decision") or {}).get("decision")}
             for c in commits if "train_s" in (c.get("metrics") or {})]
    trained = [r for r in releases if r.get("operation") == "training"]
    publish = [r["metrics"]["publish_latency_ms"] for r in trained if "publish_latency_ms" in (r.get("metrics") or {})]
    train_ms = common.percentiles([s["train_s"] * 1000 for s in steps])
    publish_ms = common.percentiles(publish)
    if steps:
        shown = f", {MAX_ROWS} of {len(steps)} shown" if len(steps) > MAX_ROWS else ""
        print(f"\ntraining steps (commits route){shown}:")
        print(common.table(["step", "batch", "train s", "decision"],
                           [[s["step"], s["batch_size"], s["train_s"], s["decision"]] for s in thin(steps)]))
    print(f"train step p50 {train_ms.get('p50')} ms, max {train_ms.get('max')} ms (n {train_ms['n']}); "
          f"publish p50 {publish_ms.get('p50')} ms (n {publish_ms['n']}); {len(poller.seen)} training release(s); "
          f"peak RSS {rss or 0:.0f} MiB")
    print(f"load avg 1m: {machine['load_avg_1m_at_start']} at start, {load_end} at end")
    problems = []
    if not rewards:
        problems.append("no rollout was reported")
    if not steps:
        problems.append("no training step was committed")
    for problem in problems:
        print("PROBLEM:", problem)
    if not steps:
        print(f"--- reef log tail ---\n{log_tail}")
    machine["load_avg_1m_at_end"] = load_end
    return {"machine": machine, "model": args.model, "minutes": args.minutes, "concurrency": args.concurrency,
            "window": window, "overrides": args.overrides, "ready_s": ready_s, "client_s": client_s,
            "wall_s": round(time.monotonic() - began, 1), "rollouts": len(rewards), "curve": curve,
            "summary": summary, "train_steps": steps, "train_step_ms": train_ms, "publish_ms": publish_ms,
            "training_releases": len(poller.seen), "peak_rss_mib": rss, "rewards": rewards, "times": times,
            "problems": problems, "targets_met": {"gain_ge_0.1": summary.get("met", False)}}
