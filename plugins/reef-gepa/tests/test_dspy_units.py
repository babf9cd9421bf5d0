"""reef_gepa.dspy without a server: records read back by signature, release files, options, the live program."""

from __future__ import annotations

import dataclasses
import json

import pytest

pytest.importorskip("dspy")

from reef_core.api import ConfigError, ValidationFailed  # noqa: E402
from reef_core.testing import PluginManager, compose_config  # noqa: E402
from reef_gepa.dspy import MANIFEST_FILE, PROGRAM_FILE, LiveProgram, chat_lm, load_program, program_files  # noqa: E402
from reef_gepa.dspy.records import example_key, held_out, recorded_inputs, recorded_outputs  # noqa: E402
from reef_gepa.dspy.trainer import DspyGepaOptions  # noqa: E402
from reef_gepa.examples.dspy_qa import CodeQA, fake_task_model  # noqa: E402


def _recorded_request(question: str) -> list[dict]:
    """The messages DSPy's chat adapter sends for CodeQA (captured from a real call)."""
    import dspy

    seen = []

    def model(messages):
        seen.append(messages)
        return fake_task_model(messages)

    with dspy.context(lm=chat_lm(model)):
        CodeQA()(question=question)
    return seen[-1]


def test_inputs_are_read_back_from_the_recorded_request():
    messages = _recorded_request("[beta] What is the code of item 8?\nTwo lines.")
    assert recorded_inputs(messages, ["question"]) == {"question": "[beta] What is the code of item 8?\nTwo lines."}
    assert recorded_inputs(messages, ["question", "context"]) is None  # the program's inputs are not all there
    assert recorded_inputs([{"role": "user", "content": "plain text"}], ["question"]) == {"question": "plain text"}
    reply = fake_task_model(messages)
    assert recorded_outputs(reply, ["answer"]) == {"answer": "I do not know the code of item 8."}
    assert recorded_outputs("no sections", ["answer"]) is None


def test_held_out_examples_are_chosen_by_their_inputs():
    keys = [example_key({"question": f"q{i}"}) for i in range(400)]
    chosen = [held_out(k, 0.25) for k in keys]
    assert chosen == [held_out(k, 0.25) for k in keys]  # stable
    assert 60 < sum(chosen) < 140
    assert example_key({"question": "a"}) == example_key({"question": "a"}) != example_key({"question": "b"})


def test_release_files_round_trip_and_refuse_a_foreign_program():
    program = CodeQA()
    program.answer.signature = program.answer.signature.with_instructions("Changed.")
    files = program_files(program)
    assert json.loads(files[MANIFEST_FILE])["program"] == "reef_gepa.examples.dspy_qa:CodeQA"
    loaded = load_program(files)
    assert loaded.dump_state() == program.dump_state() and loaded.answer.signature.instructions == "Changed."
    bad = {**files, MANIFEST_FILE: files[MANIFEST_FILE].replace('"answer"', '"other"')}
    with pytest.raises(ValidationFailed, match="predictors"):
        load_program(bad)
    with pytest.raises(ValidationFailed, match=PROGRAM_FILE):
        load_program({MANIFEST_FILE: files[MANIFEST_FILE]})


class _Client:
    """The two ReefClient calls LiveProgram makes, over an in-memory release chain."""

    def __init__(self, releases: dict[str, dict]):
        self.chain = releases
        self.current: str | None = None

    def releases(self):
        return [{"release_id": rid, "current": rid == self.current} for rid in self.chain]

    def harness(self, release_id=None):
        return {"release_id": release_id, "files": self.chain[release_id]}


def test_live_program_reloads_a_new_release_and_keeps_running_on_a_broken_one():
    better = CodeQA()
    better.answer.signature = better.answer.signature.with_instructions("Better.")
    client = _Client({"r0": program_files(CodeQA()), "r1": program_files(better), "r2": {"x.md": "not dspy"}})
    live = LiveProgram(client, seed=CodeQA(), poll_interval_s=3600)
    assert live.release_id is None and not live.refresh()
    client.current = "r1"
    assert live.refresh() and live.release_id == "r1"
    assert live.program.answer.signature.instructions == "Better."
    client.current = "r2"
    assert not live.refresh() and live.release_id == "r1" and "r2" in live.error


def test_options_are_checked_and_the_recipe_composes():
    with pytest.raises(ConfigError, match="unknown option"):
        DspyGepaOptions.from_config({"program": "a.b:C", "metric": "a.b:f", "budget": 3})
    with pytest.raises(ConfigError, match="holdout"):
        DspyGepaOptions.from_config({"program": "a.b:C", "metric": "a.b:f", "holdout": 1.5})
    cfg = compose_config(["+recipe=gepa_dspy", "recipe.options.max_metric_calls=50"], PluginManager())
    recipe = dataclasses.asdict(cfg.recipe)
    assert (recipe["processor"], recipe["trainer"], recipe["surface"]) == ("per_report", "dspy_gepa", "harness")
    assert cfg.evaluation.policy == "score_comparison"
    assert cfg.evaluation.options["evaluator"]["path"] == "reef_gepa.dspy.trainer:gate_score"
    opts = DspyGepaOptions.from_config(cfg.recipe.options)
    assert opts.max_metric_calls == 50 and opts.holdout == DspyGepaOptions.holdout
