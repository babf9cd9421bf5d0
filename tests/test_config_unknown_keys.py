"""#37: a typo'd config key is refused at start-up (exit 2, naming the key and listing the known ones), in every
typed section and in the option sections a recipe's components read; nothing is written before the refusal."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from reef_core.config import compose_config
from reef_core.errors import ConfigError


def reef(*args):
    return subprocess.run([sys.executable, "-m", "reef_core.cli", *args], capture_output=True, text=True,
                          env=dict(os.environ), timeout=180)


@pytest.mark.parametrize("override,key,known", [
    ("+server.prot=1", "server.prot", "port"),
    ("+engine.modle=x", "engine.modle", "model"),
    ("+storage.retention.keep=3", "storage.retention.keep", "keep_last"),
    ("+trainer.slime.flagz={}", "trainer.slime.flagz", "flags"),
    ("+recipe.procesor=x", "recipe.procesor", "processor"),
    ("+learn.rolouts=3", "learn.rolouts", "rollouts"),
    ("+observability.tracing.enabeld=true", "observability.tracing.enabeld", "enabled"),
    ("+observability.tracin.enabled=true", "observability.tracin", "tracing"),
])
def test_an_unknown_key_of_a_typed_section_is_refused(override, key, known):
    with pytest.raises(ConfigError) as refused:
        compose_config([override])
    assert f"unknown key {key}" in refused.value.message
    assert known in refused.value.message  # the known keys are listed


def test_an_unknown_key_of_a_route_is_refused():
    with pytest.raises(ConfigError, match="patern"):  # OmegaConf refuses it itself (a typed list)
        compose_config(["routes=[{patern: 'a-*', recipe: gepa}]"])


@pytest.mark.parametrize("args,named", [
    (["+server.prot=1"], "server.prot"),
    (["+observability.tracing.sampel=0.5"], "observability.tracing.sampel"),
    (["+recipe=sao", "+recipe.options.eps_clp=0.2"], "eps_clp"),
    (["+recipe=sao", "+recipe.processor_options.max_stalenes=2"], "max_stalenes"),
    (["+recipe=gepa", "+recipe.options.minibatch=2"], "minibatch"),
    (["+recipe=ttt", "+recipe.options.groupz=2"], "groupz"),
    (["+recipe=openclaw", "+recipe.options.lamda=2"], "lamda"),
    (["+recipe=skillclaw", "+recipe.options.batchsize=2"], "batchsize"),
])
def test_serve_refuses_an_unknown_option_at_start_up(tmp_path, args, named):
    data_dir = tmp_path / "data"
    result = reef("serve", *args, "engine.kind=upstream", "engine.upstream_url=http://127.0.0.1:9",
                  f"storage.data_dir={data_dir}")
    assert result.returncode == 2, result.stderr
    assert named in result.stderr and "known" in result.stderr and "Traceback" not in result.stderr
    assert not data_dir.exists()  # refused before anything was written
