"""Result packets (issue #38): what a learning claim rests on, written where a person can check it.

A packet is a directory holding one experiment: K seeds, each run in two arms (the recipe, and its control: the
same deployment with learning off, or the recipe's own control arm), every rollout's reward in report order.

* ``README.md``: the setting (every override of both arms), the verdict, the table of gains, wall-clock, steps,
  rollouts and the samples dropped by reason, and the diagnosis when the claim fails;
* ``metrics.json``: all of it, rewards included, for scripts;
* ``curve.png``: the mean reward per window of each arm over the seeds, with a 95% bootstrap band;
* ``samples.md``: replies chosen at random from the recipe arm's first and last windows, with their rewards.

The statistics (:func:`analyse`): an arm's *gain* is the mean reward of the last window minus that of the first,
per seed, averaged over seeds. Its 95% interval is a bootstrap that resamples the rollouts of each window of each
seed (seeds stay paired: every replicate keeps every seed). *Recipe minus control* is the difference of the two
arms' gains, the same seed paired across arms, with the same bootstrap (each replicate resamples both arms). The
claim holds when that interval lies above 0.
"""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: Bootstrap replicates per interval.
REPLICATES = 2000


@dataclass
class ArmRun:
    """One seed of one arm: rewards (and the replies they scored) in report order, and what the server said."""

    arm: str
    seed: int
    rewards: list[float]
    replies: list[dict] = field(default_factory=list)  # {"prompt", "reply", "reward"} per rollout, in order
    wall_s: float = 0.0
    steps: int = 0
    releases: int = 0
    dropped: dict[str, int] = field(default_factory=dict)


def _gain(first: list[float], last: list[float]) -> float:
    return statistics.fmean(last) - statistics.fmean(first)


def _windows(run: ArmRun, window: int) -> tuple[list[float], list[float]]:
    w = min(window, len(run.rewards) // 2)
    if w < 1:
        raise ValueError(f"{run.arm} seed {run.seed}: {len(run.rewards)} rollouts cannot make two windows")
    return run.rewards[:w], run.rewards[-w:]


def _resampled(values: list[float], rng: random.Random) -> list[float]:
    return rng.choices(values, k=len(values))


def interval(replicates: list[float]) -> list[float]:
    """The central 95% of ``replicates``."""
    ordered = sorted(replicates)
    lo = ordered[int(0.025 * (len(ordered) - 1))]
    hi = ordered[int(round(0.975 * (len(ordered) - 1)))]
    return [round(lo, 4), round(hi, 4)]


def analyse(runs: list[ArmRun], window: int, *, recipe: str = "recipe", control: str = "control",
            replicates: int = REPLICATES, seed: int = 0) -> dict:
    """Gains per arm and recipe minus control, each with its 95% bootstrap interval (see the module docstring)."""
    arms = {recipe: {}, control: {}}
    for run in runs:
        if run.arm not in arms:
            raise ValueError(f"unknown arm {run.arm!r}: expected {recipe!r} or {control!r}")
        arms[run.arm][run.seed] = _windows(run, window)
    seeds = sorted(arms[recipe])
    if not seeds or sorted(arms[control]) != seeds:
        raise ValueError(f"both arms need the same seeds: {sorted(arms[recipe])} vs {sorted(arms[control])}")
    rng = random.Random(seed)
    point = {arm: statistics.fmean(_gain(*arms[arm][s]) for s in seeds) for arm in arms}
    boot: dict[str, list[float]] = {recipe: [], control: [], "difference": []}
    for _ in range(replicates):
        gains = {arm: statistics.fmean(_gain(_resampled(arms[arm][s][0], rng), _resampled(arms[arm][s][1], rng))
                                       for s in seeds) for arm in arms}
        boot[recipe].append(gains[recipe])
        boot[control].append(gains[control])
        boot["difference"].append(gains[recipe] - gains[control])
    difference = {"mean": round(point[recipe] - point[control], 4), "ci95": interval(boot["difference"])}
    return {
        "window": window, "seeds": seeds, "replicates": replicates,
        "arms": {arm: {"gain": round(point[arm], 4), "ci95": interval(boot[arm]),
                       "per_seed": {s: round(_gain(*arms[arm][s]), 4) for s in seeds},
                       "first": round(statistics.fmean(statistics.fmean(arms[arm][s][0]) for s in seeds), 4),
                       "last": round(statistics.fmean(statistics.fmean(arms[arm][s][1]) for s in seeds), 4)}
                 for arm in arms},
        "difference": difference,
        "holds": difference["ci95"][0] > 0,
    }


def curve(runs: list[ArmRun], arm: str, window: int, *, replicates: int = 500, seed: int = 0) -> list[dict]:
    """Per window index: the arm's mean reward over seeds and a 95% bootstrap band (rollouts resampled per seed)."""
    mine = [r for r in runs if r.arm == arm]
    n = min(len(r.rewards) for r in mine) // window
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        chunks = [r.rewards[i * window:(i + 1) * window] for r in mine]
        boot = [statistics.fmean(statistics.fmean(_resampled(c, rng)) for c in chunks) for _ in range(replicates)]
        rows.append({"window": i, "rollouts": (i + 1) * window,
                     "mean": round(statistics.fmean(statistics.fmean(c) for c in chunks), 4), "ci95": interval(boot)})
    return rows


def diagnose(analysis: dict, runs: list[ArmRun], recipe: str = "recipe", control: str = "control") -> list[str]:
    """Why a claim does not hold, as far as the packet can tell (empty when it holds)."""
    if analysis["holds"]:
        return []
    out = []
    trained = [r for r in runs if r.arm == recipe]
    if not any(r.steps for r in trained):
        if any(r.dropped.get("trainer_skipped") for r in trained):
            out.append("the recipe arm committed no training step: its trainer made no candidate from any batch "
                       "(trainer_skipped)")
        else:
            out.append("the recipe arm committed no training step: its rewards never reached the learner")
    lost = sum(sum(r.dropped.values()) for r in trained)
    rollouts = sum(len(r.rewards) for r in trained)
    if rollouts and lost > 0.25 * rollouts:
        out.append(f"the recipe arm dropped {lost} of {rollouts} samples ({_reasons(trained)}): most of the signal "
                   "never trained")
    arms = analysis["arms"]
    if arms[control]["ci95"][0] > 0:
        out.append("the control arm rose too: the task stream or the sampling drifts without learning")
    if arms[recipe]["ci95"][0] <= 0:
        out.append(f"the recipe arm's own gain ({arms[recipe]['gain']:+.3f}, CI {arms[recipe]['ci95']}) is not "
                   "above 0 within this budget: more rollouts, or the recipe does not learn this task here")
    if not out:
        out.append(f"recipe minus control is {analysis['difference']['mean']:+.3f} with CI "
                   f"{analysis['difference']['ci95']}: too few seeds or rollouts to tell the arms apart")
    return out


def _reasons(runs: list[ArmRun]) -> str:
    total: dict[str, int] = {}
    for r in runs:
        for reason, n in r.dropped.items():
            total[reason] = total.get(reason, 0) + n
    return ", ".join(f"{reason} {n}" for reason, n in sorted(total.items())) or "none"


def write(directory: Path, *, title: str, setting: dict, runs: list[ArmRun], window: int, samples: int = 20,
          recipe: str = "recipe", control: str = "control") -> dict:
    """Write the packet (the four files) to ``directory``; returns metrics.json's content."""
    directory.mkdir(parents=True, exist_ok=True)
    analysis = analyse(runs, window, recipe=recipe, control=control)
    curves = {arm: curve(runs, arm, window) for arm in (recipe, control)}
    diagnosis = diagnose(analysis, runs, recipe, control)
    metrics = {"title": title, "setting": setting, "analysis": analysis, "curves": curves, "diagnosis": diagnosis,
               "runs": [asdict(r) for r in runs]}
    (directory / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    _plot(directory / "curve.png", title, curves, window)
    (directory / "samples.md").write_text(_samples(runs, recipe, window, samples))
    (directory / "README.md").write_text(_readme(title, setting, analysis, runs, diagnosis, recipe, control))
    return metrics


def _plot(path: Path, title: str, curves: dict, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no screen: render to the file only
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for arm, rows in curves.items():
        x = [r["rollouts"] for r in rows]
        ax.plot(x, [r["mean"] for r in rows], marker="o", label=arm)
        ax.fill_between(x, [r["ci95"][0] for r in rows], [r["ci95"][1] for r in rows], alpha=0.2)
    ax.set_xlabel(f"rollouts (windows of {window})")
    ax.set_ylabel("mean reward")
    ax.set_title(title, fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _samples(runs: list[ArmRun], arm: str, window: int, n: int) -> str:
    rng = random.Random(0)
    mine = [r for r in runs if r.arm == arm and r.replies]
    lines = [f"# Samples: the {arm} arm\n", f"{n} replies chosen at random from the first {window} rollouts of every "
             f"seed, and {n} from the last {window}, each with the reward its verifier gave.\n"]
    for name, pick in (("Before (first window)", lambda r: r.replies[:window]),
                       ("After (last window)", lambda r: r.replies[-window:])):
        pool = [(r.seed, row) for r in mine for row in pick(r)]
        lines.append(f"\n## {name}\n\n| seed | prompt | reply | reward |\n|---|---|---|---|")
        for seed, row in sorted(rng.sample(pool, min(n, len(pool))), key=lambda x: x[0]):
            lines.append(f"| {seed} | {_cell(row['prompt'])} | {_cell(row['reply'])} | {row['reward']:.3f} |")
    return "\n".join(lines) + "\n"


def _cell(text: Any) -> str:
    return "`" + str(text).replace("\n", "⏎").replace("|", "\\|").replace("`", "'") + "`"


def _readme(title, setting, analysis, runs, diagnosis, recipe, control) -> str:
    arms, diff = analysis["arms"], analysis["difference"]
    verdict = ("**Holds**: recipe minus control is above 0 with 95% confidence." if analysis["holds"] else
               "**Does not hold** within this budget (diagnosis below).")
    rows = []
    for arm in (recipe, control):
        mine = [r for r in runs if r.arm == arm]
        rows.append(f"| {arm} | {arms[arm]['first']:.3f} | {arms[arm]['last']:.3f} | {arms[arm]['gain']:+.3f} | "
                    f"[{arms[arm]['ci95'][0]:+.3f}, {arms[arm]['ci95'][1]:+.3f}] | "
                    f"{sum(len(r.rewards) for r in mine)} | {sum(r.steps for r in mine)} | "
                    f"{sum(r.releases for r in mine)} | {sum(r.wall_s for r in mine):.0f} | {_reasons(mine)} |")
    overrides = "\n".join(f"- {arm}: `{' '.join(o)}`" for arm, o in setting.get("overrides", {}).items())
    facts = "\n".join(f"- {k}: {v}" for k, v in setting.items() if k != "overrides")
    text = [f"# {title}\n", verdict, "",
            f"Recipe minus control (gain minus gain, seeds paired): **{diff['mean']:+.3f}**, 95% bootstrap interval "
            f"[{diff['ci95'][0]:+.3f}, {diff['ci95'][1]:+.3f}] over seeds {analysis['seeds']} "
            f"({analysis['replicates']} replicates).", "",
            "| arm | first window | last window | gain | gain 95% CI | rollouts | steps | releases | wall s "
            "| dropped |",
            "|---|---|---|---|---|---|---|---|---|---|", *rows, "",
            f"A window is {analysis['window']} rollouts; the gain is last minus first, per seed, averaged. ",
            "`curve.png` plots both arms; `samples.md` shows replies before and after; `metrics.json` has every "
            "reward.", "", "## Setting", "", facts, "", "Every override:", "", overrides, ""]
    if diagnosis:
        text += ["## Diagnosis", "", *[f"- {d}" for d in diagnosis], ""]
    return "\n".join(text)
