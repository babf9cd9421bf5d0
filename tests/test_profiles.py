"""Profiles mean what they say (issue #38 item 3): every recipe profile shipped under ``plugins/`` (a
``<recipe>_profile`` config group) is composed with the command its own comment gives, and each claim the comment
makes is checked against the config that command builds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from reef_core.testing import PluginManager, compose_config

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
PROFILES = sorted(PLUGINS.glob("*/*/conf/*_profile/*.yaml"))


def comment_of(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# "))
    return " ".join(lines[1:])  # the first line is the package directive


def claims(text: str):
    """(what the comment says, a check of the composed config) for each claim this test knows how to read."""
    lowered = text.lower()
    if re.search(r"\btiny (random-init )?(test )?model\b", lowered):
        yield "the tiny model", lambda cfg: cfg.engine.model == "tiny"
    if "full weights" in lowered:
        yield "full weights", lambda cfg: cfg.trainer.lora is False
    if re.search(r"temperature 1\b", lowered):
        yield "temperature 1", lambda cfg: cfg.engine.temperature == 1.0
    if "no weight decay" in lowered:
        yield "no weight decay", lambda cfg: cfg.recipe.options["weight_decay"] == 0.0
    turns = re.search(r"(\d+) judged turns per step", lowered)
    if turns:
        yield turns.group(0), lambda cfg: cfg.recipe.options["batch_size"] == int(turns.group(1))
    grid = re.search(r"(\d+) x (\d+) grid per step", lowered)
    if grid:
        yield grid.group(0), lambda cfg: (cfg.recipe.options["groups_per_step"],
                                          cfg.recipe.options["rollouts_per_group"]) == (int(grid.group(1)),
                                                                                        int(grid.group(2)))


def test_profiles_are_found():
    assert len(PROFILES) >= 5, PROFILES


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_profile_does_what_its_comment_says(path):
    text = comment_of(path)
    group, name = path.parent.name, path.stem
    command = re.search(r"`reef serve ([^`]+)`", text)
    assert command, f"{path}: the comment gives no `reef serve ...` command"
    overrides = command.group(1).split()
    assert f"+{group}={name}" in overrides, f"{path}: its command names another profile: {command.group(0)}"
    assert overrides[0].startswith("+recipe="), f"{path}: the command names the recipe first"
    cfg = compose_config(overrides, PluginManager())
    found = list(claims(text))
    assert found, f"{path}: no claim of its comment is checked here"
    wrong = [said for said, check in found if not check(cfg)]
    assert wrong == [], f"{path} says {wrong} but its command composes otherwise"
