"""An offline learning run: the recipe's whole loop on a task file, without HTTP.

The run builds the same :class:`~reef_core.loop.deployment.Deployment` that ``reef serve`` holds (record
store, engine, artifact store, surfaces, learners on their pool) under the job's output directory, and
plays the client itself: for each task it asks the engine for a reply the way an inference request does
(the surface shapes the request, the serving version is frozen for it), stores the inference record,
scores the reply with the task file's verifier and stores a report quoting it, both through
``Deployment.record_stored``. So records reach the recipe's processor, trainer, evaluation gate and
committer exactly as they do in a deployment, and accepted releases serve the next rollouts.

With ``learn.wait_for_learner`` (default) the run waits for the learner after each report: a ready batch
trains, and its release serves, before the next rollout, so a run is on-policy and repeatable for a seed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
import time
import uuid
from pathlib import Path

from ..config.schema import ReefConfig
from ..engines.base import GENERATE_ROUTE, EngineRequest
from ..engines.translate import translate_request, translate_response
from ..errors import ConfigError, ReefError
from ..observe.model import Record
from .taskfile import load_tasks, make_verifier

CLIENT_DIALECT = "openai"


def job_config(cfg: ReefConfig, output_dir: Path) -> ReefConfig:
    """The job's config with everything it writes under ``output_dir/data`` (jobs of a sweep never share a
    store) and the engine sampler seeded by ``seed`` unless ``engine.seed`` is set."""
    storage = dataclasses.replace(cfg.storage, data_dir=str(output_dir / "data"), records_url=None,
                                  records_schema=None, artifact_repository=None)
    engine = cfg.engine if cfg.engine.seed is not None else dataclasses.replace(cfg.engine, seed=cfg.seed)
    return dataclasses.replace(cfg, storage=storage, engine=engine)


def run_learning(cfg: ReefConfig, output_dir: Path) -> dict:
    """Run the loop on ``cfg.learn``'s task file; return the run's metrics (see :func:`reward_curve`)."""
    learn = cfg.learn
    if learn.rollouts < 1 or learn.window < 1:
        raise ConfigError("learn.rollouts and learn.window must be at least 1")
    if not learn.step_timeout_s > 0:
        raise ConfigError("learn.step_timeout_s must be positive")
    tasks = load_tasks(learn.file)
    verify = make_verifier(learn.verifier, learn.verifier_options)
    return asyncio.run(_run(job_config(cfg, output_dir), tasks, verify))


async def _run(cfg: ReefConfig, tasks: list[dict], verify) -> dict:
    from .assemble import build_deployment

    learn = cfg.learn
    dep = build_deployment(cfg)
    started = time.perf_counter()
    rewards: list[float] = []
    unscored = 0
    await dep.start()
    try:
        scenario = await dep.create_scenario(learn.scenario)  # the offline client sends only valid requests
        learner = dep.learner(scenario)
        order = _task_order(len(tasks), learn.rollouts, cfg.seed)
        for index in order:
            task = tasks[index]
            record, text = await _rollout(dep, scenario, task)
            value = verify(text, task)
            if value is None:  # a verifier fault is no reward: the rollout is recorded, never reported
                unscored += 1
                continue
            rewards.append(value)
            await _report(dep, scenario, record, value)
            if learn.wait_for_learner:
                await _settle(dep, scenario.name, learn.step_timeout_s)
        await _settle(dep, scenario.name, learn.step_timeout_s)  # the last ready batch trains
        status = learner.status()
        releases = dep.release_rows(scenario.name)
    finally:
        await dep.stop()
    counters = status["counters"]
    return {
        **reward_curve(rewards, learn.window),
        "rollouts": len(order),
        "unscored": unscored,
        "steps": counters["steps"],
        "versions_published": counters["selected"],
        "rejected": counters["rejected"],
        "skipped": counters["skipped"],
        "errors": counters["errors"],
        "last_error": status["last_error"],
        "releases": [{"release_id": r.get("release_id"), "operation": r.get("operation"),
                      "current": r.get("current")} for r in releases],
        "wall_s": round(time.perf_counter() - started, 3),
    }


def _task_order(count: int, rollouts: int, seed: int) -> list[int]:
    """Task indices for ``rollouts`` rollouts: the file shuffled by ``seed``, reshuffled on each pass."""
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < rollouts:
        one_pass = list(range(count))
        rng.shuffle(one_pass)
        order.extend(one_pass)
    return order[:rollouts]


async def _rollout(dep, scenario, task: dict) -> tuple[Record, str]:
    """One generation as an inference request makes it; the stored record and the reply's text."""
    engine = dep.engine
    body = {"model": "reef", "messages": task["messages"]}
    if dep.cfg.learn.max_tokens:  # the task's reply budget, as its client would send it
        body["max_tokens"] = int(dep.cfg.learn.max_tokens)
    release_id = None
    surface = dep.surface_for(scenario)
    if surface is not None:
        body, release_id = surface.prepare_request(scenario.name, CLIENT_DIALECT, body)
    dialect = CLIENT_DIALECT if CLIENT_DIALECT in engine.dialects else engine.dialects[0]
    request_body = translate_request(body, CLIENT_DIALECT, dialect, dep.cfg.engine.max_new_tokens)
    version = dep.serving_version(scenario)
    request = EngineRequest(dialect=dialect, route=GENERATE_ROUTE[dialect], body=request_body, version=version)
    started = time.perf_counter()
    result = await engine.complete(request)
    if result.status >= 400:
        raise ReefError(f"the engine refused a task's request ({result.status}): {result.body}")
    payload = {"route": request.route, "dialect": dialect, "client_dialect": CLIENT_DIALECT,
               "request": request_body, "response": result.body, "engine": engine.name, "stream": False,
               "timings": {"engine_ms": round((time.perf_counter() - started) * 1000, 3)}}
    if result.tokens is not None:
        payload["tokens"] = result.tokens.to_dict()
    if release_id:
        payload["release_id"] = release_id
    tokens_version = result.tokens.version if result.tokens is not None else None
    record = Record(record_id=uuid.uuid4().hex, scenario=scenario.name, kind="inference", payload=payload,
                    tags={"task": str(task.get("id", ""))} if task.get("id") is not None else {},
                    version=tokens_version or result.version or version,
                    top_k=result.tokens.packed_top_k() if result.tokens is not None else None)
    stored = await dep.record_stored(record)
    return stored, _reply_text(translate_response(result.body, dialect, CLIENT_DIALECT))


async def _report(dep, scenario, record: Record, value: float) -> None:
    """A report quoting ``record``, validated as ``POST /reef/report`` validates one."""
    from ..observe.reports import validate_report

    report = validate_report({"score": value, "references": [record.record_id]})
    schema = dep.report_schema(scenario)
    if schema is not None:
        schema(dict(report))
    await dep.record_stored(Record(record_id=uuid.uuid4().hex, scenario=scenario.name, kind="report",
                                   payload={"score": report["score"]}, references=report["references"]),
                            check_references=True)


async def _settle(dep, scenario: str, timeout: float) -> None:
    """Wait until the scenario's learner neither runs nor waits for a turn."""
    if not await asyncio.to_thread(dep.pool.wait_idle, scenario, timeout):
        raise ReefError(f"the learner of scenario {scenario!r} did not finish a turn within {timeout} s "
                        "(learn.step_timeout_s)")


def _reply_text(body: dict) -> str:
    try:
        return body["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError):
        return ""


def reward_curve(rewards: list[float], window: int) -> dict:
    """Mean reward per window of ``window`` rollouts (the last one may be shorter), first and last window."""
    curve = [round(statistics.mean(rewards[i:i + window]), 6) for i in range(0, len(rewards), window)]
    return {"rewards": rewards, "window": window, "reward_curve": curve,
            "first_window_mean": curve[0] if curve else None, "last_window_mean": curve[-1] if curve else None}
