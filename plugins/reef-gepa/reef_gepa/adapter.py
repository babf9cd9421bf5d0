"""The GEPA adapter: how a candidate (component texts) runs on episodes and how reflection sees them.

``HarnessAdapter`` implements gepa's ``GEPAAdapter`` protocol (``evaluate`` and
``make_reflective_dataset``; ``propose_new_texts = None`` keeps the library's own reflective
proposer with its default instruction template). A candidate becomes a system prompt with the
same rule as the harness surface (:func:`reef_core.surfaces.harness.render_system_prompt` over the
served tree with the candidate's components swapped in), is injected in front of the episode's
client messages exactly as the surface injects it, and the output is scored by the verifier.
Reflection records use GEPA's keys: ``Inputs``, ``Generated Outputs``, ``Feedback``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gepa.core.adapter import EvaluationBatch

from reef_core.api import ChatModel, inject_system, render_system_prompt

from .episodes import Episode, Feedback, Verifier, as_score, task_key, task_messages

log = logging.getLogger("reef_gepa")

#: GEPA's reflective-dataset keys; the library's instruction template refers to them by name.
INPUTS, OUTPUTS, FEEDBACK = "Inputs", "Generated Outputs", "Feedback"


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class EpisodeResult:
    output: str
    score: float
    feedback: str | None = None
    reused: bool = False
    error: str | None = None


class OutputCache:
    """Outputs by (system prompt digest, task key), so the gate re-uses what GEPA's validation ran."""

    def __init__(self, capacity: int = 20000):
        self.capacity = capacity
        self._data: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str]) -> str | None:
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: tuple[str, str], value: str) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)


class TaskRunner:
    """Runs tasks with a harness tree through the task model and scores them."""

    def __init__(self, task_model: ChatModel, verifier: Verifier, feedback: Feedback,
                 system_files: Sequence[str], cache: OutputCache):
        self.task_model = task_model
        self.verifier = verifier
        self.feedback = feedback
        self.system_files = tuple(system_files)
        self.cache = cache

    def system_text(self, tree: Mapping[str, str]) -> str:
        return render_system_prompt(tree, self.system_files)

    def output(self, harness: str, messages: list[dict], key: str) -> str:
        """The task model's answer to ``messages`` under ``harness`` (cached per harness and task)."""
        cache_key = (text_digest(harness), key)
        cached = self.cache.get(cache_key)
        if cached is not None:
            return cached
        body = inject_system("openai", {"messages": messages}, harness, "extend")
        out = self.task_model(body["messages"])
        self.cache.put(cache_key, out)
        return out

    def run_task(self, tree: Mapping[str, str], task: dict) -> str:
        """Output of ``task`` run with ``tree`` (the gate's ``run``)."""
        return self.output(self.system_text(tree), task_messages(task), task_key(task))

    def episode(self, episode: Episode, harness: str, with_feedback: bool) -> EpisodeResult:
        traffic = episode.traffic
        if traffic is not None and traffic.harness == harness:
            feedback = traffic.feedback
            if with_feedback and feedback is None:
                feedback = self.feedback(episode.task, traffic.output, traffic.score)
            return EpisodeResult(traffic.output, traffic.score, feedback, reused=True)
        try:
            output = self.output(harness, episode.messages, episode.key)
        except Exception as exc:  # noqa: BLE001 - a failed episode scores 0 and says why
            log.warning("episode %s failed: %s: %s", episode.key, type(exc).__name__, exc)
            return EpisodeResult("", 0.0, f"The episode failed to run: {type(exc).__name__}: {exc}",
                                 error=str(exc))
        try:
            score = as_score(self.verifier(output, episode.task))
        except Exception as exc:  # noqa: BLE001
            log.warning("verifier failed on %s: %s: %s", episode.key, type(exc).__name__, exc)
            return EpisodeResult(output, 0.0, f"The answer could not be verified: {exc}", error=str(exc))
        feedback = self.feedback(episode.task, output, score) if with_feedback else None
        return EpisodeResult(output, score, feedback)


class HarnessAdapter:
    """gepa ``GEPAAdapter`` over :class:`TaskRunner` for one served tree (see the module docstring)."""

    #: None: use gepa's reflective proposer (default instruction template + fence extractor).
    propose_new_texts = None

    def __init__(self, runner: TaskRunner, base_tree: Mapping[str, str], instructions: list[str] | None = None):
        self.runner = runner
        self.base_tree = dict(base_tree)
        #: A person's instructions for this step (``POST /reef/train``): reflection input beside each episode's
        #: feedback, so the proposal answers them.
        self.instructions = list(instructions or [])
        #: Episodes evaluated with traffic reuse (free of model calls), for metrics.
        self.reused = 0

    def tree(self, candidate: Mapping[str, str]) -> dict[str, str]:
        return {**self.base_tree, **candidate}

    def evaluate(self, batch: list[Episode], candidate: dict[str, str], capture_traces: bool = False) -> EvaluationBatch:
        harness = self.runner.system_text(self.tree(candidate))
        results = [self.runner.episode(ep, harness, capture_traces) for ep in batch]
        self.reused += sum(r.reused for r in results)
        trajectories = None
        if capture_traces:
            trajectories = [{"input": ep.input, "output": r.output, "score": r.score, "feedback": r.feedback or ""}
                            for ep, r in zip(batch, results)]
        return EvaluationBatch(outputs=[r.output for r in results], scores=[r.score for r in results],
                               trajectories=trajectories)

    def make_reflective_dataset(self, candidate: dict[str, str], eval_batch: EvaluationBatch,
                                components_to_update: list[str]) -> dict[str, list[dict[str, Any]]]:
        asked = "".join(f"\n\nInstruction from a person: {text}" for text in self.instructions)
        records = [{INPUTS: t["input"], OUTPUTS: t["output"], FEEDBACK: (t["feedback"] + asked).strip()}
                   for t in eval_batch.trajectories or ()]
        return {component: [dict(r) for r in records] for component in components_to_update}
