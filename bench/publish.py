"""Publish latency and training-step time of the learning loop: SAO on the tiny CPU model, over real HTTP.

``reef serve +recipe=sao +sao_profile=tiny`` with the local engine. A reporting client sends a task, scores the
reply with the recipe's verifier and reports the score quoting the receipt; every 4 reports the learner trains one
step, the gate (policy ``always``) selects it and the new weights are published while serving continues. A
bystander client keeps chatting, so a request is always waiting for the new version.

Reef measures publish latency itself (reef_core/loop/learner.py): from the moment the candidate is selected to
the first stored record served by the new version, which covers the git commit of a durable release (every
``--checkpoint-every``-th version), the weight swap into the engine, and the wait for the next request to finish
on the new weights. ``train_s`` is the trainer's step time. Both are read from the releases route; versions that
stay in memory (live) show up there only while current, so the route is polled after every report.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench import common

TARGET_TINY_MS = 50.0
TARGET_SMOLLM2_LORA_MS = 1000.0


def add_arguments(parser) -> None:
    parser.add_argument("--versions", type=int, default=6, help="published versions to wait for (default 6)")
    parser.add_argument("--checkpoint-every", type=int, default=2,
                        help="trainer.checkpoint_every_n_versions: every N-th version is a durable git release, "
                             "the others stay in memory (default 2: both kinds)")
    parser.add_argument("--timeout", type=float, default=240, help="give up after this many seconds")
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                        help="tiny (random-init test model, full weights) or smollm2 (SmolLM2-135M-Instruct)")
    parser.add_argument("--lora", action="store_true", help="train and publish LoRA adapters (trainer.lora=true)")
    parser.add_argument("--model-dir", default=None,
                        help="a local model directory to train instead of --model (the tiny profile's settings; "
                             "scripts/gpu_check.sh passes a real-size random-init model)")
    parser.add_argument("--device", default="auto", help="engine.device (the trainer follows it): auto, cpu, cuda")
    parser.add_argument("--engine", choices=("local", "sglang", "vllm"), default="local",
                        help="local (embedded engine), sglang or vllm (engine.kind=sglang / vllm in front of the "
                             "FakeSGLang / FakeVLLM test server, a real tiny model behind that server's HTTP routes "
                             "in its own process)")


def _post(url: str, body: dict, headers: dict) -> tuple[dict, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json", **headers})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read()), {k.lower(): v for k, v in response.headers.items()}


def _chat(base: str, scenario: str, messages: list[dict]) -> tuple[str, str]:
    body, headers = _post(f"{base}/v1/chat/completions", {"model": "tiny", "messages": messages},
                          {"x-reef-scenario": scenario, "authorization": f"Bearer {common.TOKEN}"})
    return headers["x-reef-agent-record-id"], body["choices"][0]["message"]["content"] or ""


def run(args) -> dict:
    try:
        from reef_sao import tasks as sao_tasks
    except ImportError as exc:
        raise SystemExit(f"the publish benchmark needs the reef-sao recipe package: {exc}") from None

    machine = common.machine()
    workdir = Path(tempfile.mkdtemp(prefix="reef-bench-publish-"))
    scenario = "bench-publish"
    port = common.free_port()
    if args.model_dir:
        profile = ["+sao_profile=tiny", f"engine.model={args.model_dir}"]
    elif args.model == "tiny":
        profile = ["+sao_profile=tiny"]
    else:  # SmolLM2 on CPU: small batches and short replies keep a step within seconds
        profile = ["engine.model=smollm2", "engine.max_new_tokens=12", "recipe.options.batch_size=2",
                   "trainer.grad_accumulation=1", "trainer.lr=1e-5", "recipe.processor_options.max_staleness=4"]
    if args.lora:
        profile.append("trainer.lora=true")
    profile.append(f"engine.device={args.device}")
    model_cache = os.environ.get("REEF_MODEL_CACHE", str(workdir / "models"))
    fake = None
    if args.engine in ("sglang", "vllm"):
        from reef_core.models.loading import resolve_model

        # The server and Reef read the same model directory (what engine.model resolves to).
        model_dir = resolve_model(args.model_dir or args.model, workdir / "data", Path(model_cache))
        fake_port = common.free_port()
        fake_env = None
        if args.engine == "sglang":
            fake_cmd = [common.PYTHON, "-m", "reef_core.testing.fake_sglang", "--model-dir", str(model_dir)]
        else:  # launched as `vllm serve` is, with the variables its weight and adapter routes need
            fake_cmd = [common.PYTHON, "-m", "reef_core.testing.fake_vllm", "serve", str(model_dir), "--enable-lora"]
            fake_env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        fake = common.Child(f"fake-{args.engine}", [*fake_cmd, "--port", str(fake_port)],
                            f"http://127.0.0.1:{fake_port}", workdir / f"fake-{args.engine}.log", env=fake_env,
                            health="/health")
        profile += [f"engine.kind={args.engine}", f"engine.url={fake.url}"]
    cmd = [common.PYTHON, "-m", "reef_core.cli", "serve", "+recipe=sao", *profile, "engine.seed=0",
           "seed=0", f"trainer.checkpoint_every_n_versions={args.checkpoint_every}", f"server.port={port}",
           f"storage.data_dir={workdir / 'data'}", "server.log_level=warning"]
    env = {"REEF_TOKEN": common.TOKEN, "REEF_MODEL_CACHE": model_cache}
    reef = common.Child("reef", cmd, f"http://127.0.0.1:{port}", workdir / "reef.log", env=env,
                        unset=("REEF_ADMIN_TOKEN",))
    releases: dict[str, dict] = {}
    stop = threading.Event()
    bystander_errors: list[str] = []
    served = {"n": 0}
    began = time.monotonic()
    try:
        if fake is not None:
            fake.start(timeout=120)
        reef.start(timeout=300)

        def bystander() -> None:
            while not stop.is_set():
                try:
                    _chat(reef.url, scenario, [{"role": "user", "content": "keep talking"}])
                    served["n"] += 1
                except Exception as exc:  # noqa: BLE001 - reported below
                    bystander_errors.append(repr(exc))
                    stop.wait(0.1)

        thread = threading.Thread(target=bystander, daemon=True)
        thread.start()
        stream = sao_tasks.task_stream(seed=0)
        reports = 0
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            task = next(stream)
            receipt, text = _chat(reef.url, scenario, task.messages())
            _post(f"{reef.url}/reef/report", {"score": sao_tasks.score(task, text), "references": [receipt]},
                  {"x-reef-scenario": scenario, "authorization": f"Bearer {common.TOKEN}"})
            reports += 1
            rows = _get_releases(reef.url, scenario)
            for row in rows:
                if row.get("operation") == "training":
                    releases.setdefault(row["release_id"], {}).update(
                        {"kind": row.get("content_kind") or ("checkpoint" if row.get("checkpoint") else "release"),
                         **{k: v for k, v in (row.get("metrics") or {}).items()
                            if k in ("publish_latency_ms", "commit_ms", "first_response_ms", "serving_version")}})
            if sum("publish_latency_ms" in r for r in releases.values()) >= args.versions:
                break
        stop.set()
        thread.join(60)
        # Step times from the commit log: one row per training step, selected or not.
        steps = [row for row in _get_json(reef.url, f"/reef/scenarios/{scenario}/commits?limit=100")
                 .get("commits", []) if "train_s" in (row.get("metrics") or {})]
        rss = reef.peak_rss_mib()
    finally:
        stop.set()
        reef.stop()
        if fake is not None:
            fake.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    published = {k: v for k, v in releases.items() if "publish_latency_ms" in v}
    live = [v["publish_latency_ms"] for v in published.values() if v["kind"] == "live_weights"]
    durable = [v["publish_latency_ms"] for v in published.values() if v["kind"] != "live_weights"]
    commit = [v["commit_ms"] for v in published.values() if v["kind"] != "live_weights" and "commit_ms" in v]
    train = [row["metrics"]["train_s"] * 1000 for row in steps]
    rows = [[rid[:24], v["kind"], v.get("commit_ms"), v.get("publish_latency_ms"), v.get("first_response_ms")]
            for rid, v in releases.items()]
    print(f"model {args.model_dir or args.model}{' (LoRA)' if args.lora else ''}, engine {args.engine}")
    print(common.table(["release", "kind", "commit ms", "publish ms", "first response ms"], rows))
    summary = {"live_publish_ms": common.percentiles(live), "durable_publish_ms": common.percentiles(durable),
               "durable_commit_ms": common.percentiles(commit),
               "train_step_ms": common.percentiles(train)}
    print(f"live versions: publish p50 {summary['live_publish_ms'].get('p50')} ms; durable releases: publish p50 "
          f"{summary['durable_publish_ms'].get('p50')} ms (of which the commit {summary['durable_commit_ms'].get('p50')} ms); train step p50 {summary['train_step_ms'].get('p50')} ms; "
          f"{reports} reports, {served['n']} bystander requests, peak RSS {rss:.0f} MiB")
    problems = []
    if len(published) < args.versions:
        problems.append(f"only {len(published)} of {args.versions} versions published within {args.timeout:g} s")
    if bystander_errors:
        problems.append(f"{len(bystander_errors)} bystander requests failed: {bystander_errors[:2]}")
    for problem in problems:
        print("PROBLEM:", problem)
    all_publish = live + durable
    return {"machine": machine, "model": args.model, "lora": args.lora, "engine": args.engine, "wall_s": round(time.monotonic() - began, 1), "releases": releases,
            "train_steps": [{"step": row.get("step"), "train_s": row["metrics"]["train_s"],
                             "batch_size": row["metrics"].get("batch_size")} for row in steps],
            "summary": summary, "reports": reports, "bystander_requests": served["n"], "peak_rss_mib": rss,
            "problems": problems,
            "targets_met": _targets(args, all_publish)}


def _targets(args, publish: list[float]) -> dict:
    if not publish:
        return {}
    if args.model == "tiny":
        return {"publish_le_50ms_tiny": max(publish) <= TARGET_TINY_MS}
    if args.lora:
        return {"publish_le_1s_smollm2_lora": max(publish) <= TARGET_SMOLLM2_LORA_MS}
    return {}


def _get_json(base: str, path: str) -> dict:
    """GET a Reef route; ``{}`` while it answers 404 (the scenario or its learner does not exist yet)."""
    request = urllib.request.Request(base + path, headers={"authorization": f"Bearer {common.TOKEN}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return {}
        raise


def _get_releases(base: str, scenario: str) -> list[dict]:
    return _get_json(base, f"/reef/scenarios/{scenario}/releases").get("releases", [])
