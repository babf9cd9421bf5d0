"""``observability.tracing`` is checked at start-up: a bad value names its key, a header's unset environment variable
is named, and tracing without the ``otel`` extra exits 2 naming the install step, before anything is written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from reef_core.config import compose_config
from reef_core.errors import ConfigError
from reef_core.loop.assemble import build_deployment, open_tracing

KEY = "observability.tracing"


@pytest.mark.parametrize("override,key", [
    (f"{KEY}.protocol=thrift", f"{KEY}.protocol"),
    (f"{KEY}.sample=1.5", f"{KEY}.sample"),
    (f"{KEY}.sample=-0.1", f"{KEY}.sample"),
    (f"{KEY}.endpoint=collector:4318", f"{KEY}.endpoint"),
    (f"{KEY}.endpoint=http://collector:99999", f"{KEY}.endpoint"),
    (f"{KEY}.service_name=' '", f"{KEY}.service_name"),
    (f"{KEY}.max_queue_size=0", f"{KEY}.max_queue_size"),
    (f"{KEY}.max_export_batch_size=4096", f"{KEY}.max_export_batch_size"),
    (f"{KEY}.export_timeout_s=0", f"{KEY}.export_timeout_s"),
    (f"{KEY}.schedule_delay_s=-1", f"{KEY}.schedule_delay_s"),
    (f"+{KEY}.headers.Authorization=OTLP_AUTH", f"{KEY}.headers"),
    (f"+{KEY}.headers.authorization='not a variable'", f"{KEY}.headers.authorization"),
    (f"{KEY}.enabled=sometimes", f"{KEY}.enabled"),
    (f"+{KEY}.sampel=0.5", f"{KEY}.sampel"),
])
def test_a_bad_value_is_refused_naming_its_key(override, key):
    with pytest.raises(ConfigError) as refused:
        compose_config([override])
    assert key in refused.value.message


def test_defaults_and_endpoints():
    tracing = compose_config([]).observability.tracing
    assert (tracing.enabled, tracing.protocol, tracing.service_name, tracing.sample, tracing.include_content) == (
        False, "http/protobuf", "reef", 1.0, False)
    assert open_tracing(compose_config([])) is None  # off: nothing built, no extra needed
    from reef_core.config.tracing import endpoint_url

    def url(*overrides):
        return endpoint_url(compose_config(list(overrides)).observability.tracing)

    assert url() == "http://127.0.0.1:4318/v1/traces"
    assert url(f"{KEY}.protocol=grpc") == "http://127.0.0.1:4317"
    assert url(f"{KEY}.endpoint=http://collector:4318") == "http://collector:4318/v1/traces"
    assert url(f"{KEY}.endpoint=https://collector/otlp/v1/traces") == "https://collector/otlp/v1/traces"


def test_an_unset_header_variable_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("REEF_TEST_UNSET_OTLP", raising=False)
    cfg = compose_config([f"{KEY}.enabled=true", f"+{KEY}.headers.authorization=REEF_TEST_UNSET_OTLP",
                          "engine.kind=upstream", "engine.upstream_url=http://127.0.0.1:9",
                          f"storage.data_dir={tmp_path}/data"])
    with pytest.raises(ConfigError) as refused:
        build_deployment(cfg)
    assert "REEF_TEST_UNSET_OTLP" in refused.value.message and f"{KEY}.headers.authorization" in refused.value.message
    assert not (tmp_path / "data").exists()


# The OpenTelemetry SDK made unimportable, as on a machine without the extra.
_WITHOUT_OTEL = """
import importlib.abc, sys
class Without(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry.sdk" or name.startswith("opentelemetry.exporter"):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Without())
from reef_core.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_tracing_without_the_extra_exits_2_naming_the_install_step(tmp_path):
    data_dir = tmp_path / "data"
    result = subprocess.run([sys.executable, "-c", _WITHOUT_OTEL, "serve", f"{KEY}.enabled=true",
                             "engine.kind=upstream", "engine.upstream_url=http://127.0.0.1:9",
                             f"storage.data_dir={data_dir}"], capture_output=True, text=True, env=dict(os.environ),
                            timeout=120)
    assert result.returncode == 2, result.stderr
    assert "reef-core[otel]" in result.stderr and "pip install" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not data_dir.exists()
