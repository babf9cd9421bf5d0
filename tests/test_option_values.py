"""reef_core.api.option_values: the one reader of recipe and judge options."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from reef_core.api import ConfigError, option_values


@dataclass
class Knobs:
    batch_size: int = 4
    lam: float = 1.0


def test_kebab_case_aliases_and_keys_of_another_reader():
    assert option_values(Knobs, None, who="x") == {}
    assert option_values(Knobs, {"batch-size": 8, "lambda": 0.5, "max_staleness": 2}, who="x",
                         aliases={"lambda": "lam"}, ignore={"max_staleness"}) == {"batch_size": 8, "lam": 0.5}


def test_unknown_keys_and_non_mappings_are_refused_naming_where():
    with pytest.raises(ConfigError, match=r"^x: unknown option 'batch_sise' in recipe.options \(known: batch_size, lam\)"):
        option_values(Knobs, {"batch_sise": 8}, who="x")
    with pytest.raises(ConfigError, match=r"^judge 'j': judges.j must be a mapping, got list"):
        option_values(Knobs, [1], who="judge 'j'", section="judges.j")
