"""``storage.retention``'s record keys: typed, refused at start-up naming the key, and resolved per scenario."""

from __future__ import annotations

import pytest

from reef_core.config import compose_config
from reef_core.config.record_retention import parse_duration, scenario_retention
from reef_core.errors import ConfigError


@pytest.mark.parametrize("override,key", [
    ("storage.retention.max_age=3x", "storage.retention.max_age"),
    ("storage.retention.max_age=0", "storage.retention.max_age"),
    ("storage.retention.max_bytes=-1", "storage.retention.max_bytes"),
    ("storage.retention.interval_s=-5", "storage.retention.interval_s"),
    ("storage.retention.chunk_records=0", "storage.retention.chunk_records"),
    ("storage.retention.max_records_per_pass=0", "storage.retention.max_records_per_pass"),
    ("storage.retention.scenarios=[{pattern: 'a-*', max_age: soon}]", "storage.retention.scenarios[0].max_age"),
    ("storage.retention.scenarios=[{pattern: '', max_age: 1d}]", "storage.retention.scenarios[0].pattern"),
    ("+storage.retention.max_agee=1d", "storage.retention.max_agee"),
])
def test_a_bad_record_retention_value_is_refused_naming_its_key(override, key):
    with pytest.raises(ConfigError) as refused:
        compose_config([override])
    assert key in refused.value.message


def test_defaults_durations_and_per_scenario_rules():
    section = compose_config([]).storage.retention
    assert (section.max_age, section.max_bytes, section.keep_scored, section.interval_s) == (None, None, True, 3600)
    assert [parse_duration(v, "k") for v in ("30d", "12h", "15m", "90", "2w", None, "forever")] == \
        [30 * 86400, 12 * 3600, 900, 90, 14 * 86400, None, None]
    section = compose_config(["storage.retention.max_age=30d", "storage.retention.scenarios=["
                              "{pattern: 'eval-*', max_age: forever, keep_scored: false, max_bytes: 1000},"
                              "{pattern: 'tmp-*', max_age: 1h}]"]).storage.retention
    assert scenario_retention(section, "prod").max_age_s == 30 * 86400
    evals = scenario_retention(section, "eval-1")
    assert (evals.max_age_s, evals.keep_scored, evals.max_bytes) == (None, False, 1000)
    assert scenario_retention(section, "tmp-x").max_age_s == 3600 and scenario_retention(section, "tmp-x").keep_scored
