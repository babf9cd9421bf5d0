"""Reef's slime command line against slime's real argument list (``reef_core.config.slime_args``), and the FAKE
job following the real ``train.py`` where Reef once got it wrong (issue #34: no ``--load``/``--ref-load``, no
``--save-interval``, the removed ``--megatron-to-hf-mode``).

The parser below is the test's own, written from ``slime_args``: every flag known to slime, none removed, none
twice, and what a train-only job requires present.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from reef_core.config import compose_config
from reef_core.config.schema import SlimeConfig, TrainerConfig
from reef_core.errors import ConfigError
from reef_core.models.loading import build_tiny_model
from reef_core.grow.slime import flags as slime_flags
from reef_core.grow.slime import marker as m
from reef_core.config import slime_args
from reef_core.grow.slime.trainer import SlimeJobFailed, SlimeTrainer
from reef_core.surfaces.weights import MODEL_FILE
from reef_core.testing import fake_slime
from reef_sao.objectives import SAOObjective

from .test_slime_backend import LAUNCH, CommitLog, _batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _parse(argv: list[str]) -> dict[str, list[str]]:
    """``{flag: [values]}`` of a slime command line, refusing what slime's list refuses."""
    out: dict[str, list[str]] = {}
    flag = None
    for token in argv:
        if token.startswith("--"):
            assert token not in slime_args.REMOVED, f"{token} was removed from slime"
            assert token in slime_args.KNOWN, f"{token} is not a flag of slime {slime_args.SLIME_COMMIT[:8]}"
            assert token not in out, f"{token} given twice"
            flag = token
            out[flag] = []
        else:
            assert flag is not None, f"{token!r} before any flag"
            out[flag].append(token)
    for alternatives, why in slime_args.REQUIRED.items():
        assert any(a in out for a in alternatives), f"none of {alternatives} ({why})"
    return out


def _saves(rollout_id: int, interval: int | None, num_rollout: int) -> bool:
    """slime's ``should_run_periodic_action`` for the save of ``train.py`` (``slime/utils/misc.py``)."""
    if interval is None:
        return False
    return rollout_id == num_rollout - 1 or (rollout_id + 1) % interval == 0


def _job(tok, tmp_path: Path, objective, flags: dict, driver) -> Path:
    """Reef writes a job for a batch of 2 and hands it to ``driver`` (in-process); the job's directory."""
    t = SlimeTrainer(objective, launch=LAUNCH, flags=flags, jobs_dir=tmp_path / "jobs", timeout_s=120, lr=1e-2,
                     load_base_model=lambda: build_tiny_model(seed=0, tokenizer=tok), device="cpu")
    seen = {}

    def run(job_dir):
        seen["dir"] = job_dir
        driver(job_dir)

    t.run_driver = run
    try:
        t.train(_batch(2), CommitLog().ctx())
    except SlimeJobFailed:
        pass
    return seen["dir"]


def _args(job_dir: Path) -> list[str]:
    return json.loads((job_dir / "job.json").read_text())["slime_args"]


def _edit_args(job_dir: Path, edit) -> None:
    job = json.loads((job_dir / "job.json").read_text())
    job["slime_args"] = edit(list(job["slime_args"]))
    (job_dir / "job.json").write_text(json.dumps(job))


def _without(argv: list[str], flag: str) -> list[str]:
    i = argv.index(flag)
    n = 1
    while i + n < len(argv) and not argv[i + n].startswith("--"):
        n += 1
    return argv[:i] + argv[i + n:]


def _sao():
    return SAOObjective(eps_clip=0.99, eps_clip_high=50.0, critic_steps_per_actor=1, num_critic_only_steps=0)


# --------------------------------------------------------------------------- the list itself


def test_the_list_names_the_slime_commit_and_files_it_was_read_from():
    assert len(slime_args.SLIME_COMMIT) == 40 and int(slime_args.SLIME_COMMIT, 16)
    assert slime_args.SLIME_COMMIT in slime_args.__doc__ and slime_args.MEGATRON_COMMIT in slime_args.__doc__
    for path in ("slime/utils/arguments.py", "train.py", "slime/backends/megatron_utils/model.py"):
        assert path in slime_args.SOURCES and path in slime_args.__doc__
    assert not set(slime_args.REMOVED) & slime_args.KNOWN
    flat = {f for alternatives in slime_args.REQUIRED for f in alternatives}
    assert flat <= slime_args.KNOWN


def test_every_flag_reef_sets_or_lets_through_is_one_slime_knows():
    for name, group in (("ALLOWED", slime_flags.ALLOWED), ("REEF_OWNED", slime_flags.REEF_OWNED),
                        ("CUSTOM_LOSS_REFUSED", slime_flags.CUSTOM_LOSS_REFUSED)):
        assert not group & set(slime_args.REMOVED), (name, group & set(slime_args.REMOVED))
        assert group <= slime_args.KNOWN, (name, sorted(group - slime_args.KNOWN))


# --------------------------------------------------------------------------- S3: removed flags


def test_a_removed_flag_is_refused_at_config_load_naming_it():
    with pytest.raises(ConfigError, match=r"--megatron-to-hf-mode .*removed"):
        compose_config(["trainer.backend=slime", "+trainer.slime.flags={--megatron-to-hf-mode: raw}"])
    with pytest.raises(ConfigError, match=r"--megatron-to-hf-mode .*removed"):
        SlimeConfig(flags={"--megatron-to-hf-mode": "bridge"})


def test_a_job_command_line_with_a_flag_slime_lacks_is_never_launched(tok, tmp_path):
    """A trainer built without the config check (flags straight to the constructor) still refuses before launching."""
    for flag in ("--megatron-to-hf-mode", "--bogus-flag"):
        t = SlimeTrainer(fake_slime.ReinforceObjective(), launch=LAUNCH, flags={flag: "raw"}, jobs_dir=tmp_path,
                         timeout_s=120, lr=1e-2, load_base_model=lambda: build_tiny_model(seed=0, tokenizer=tok))
        with pytest.raises(ConfigError, match=f"slime job arguments: {flag} "):
            t.train(_batch(2), CommitLog().ctx())
        assert t.launched == 0
    with pytest.raises(ConfigError, match="--load or --ref-load missing"):
        slime_flags.check_argv(_without(slime_flags.job_argv("sft_loss", {}, lr=1.0, rollout="r", hf_in="i",
                                                             hf_out="o", save="m", samples=1), "--load"))


# --------------------------------------------------------------------------- S1, S2: the generated arguments


@pytest.mark.parametrize("family", ["policy", "sao"])
def test_the_job_arguments_parse_against_slimes_list(family, tok, tmp_path):
    objective = fake_slime.ReinforceObjective() if family == "policy" else _sao()
    job_dir = _job(tok, tmp_path, objective, {"--seed": 3, "--global-batch-size": 2, "--bf16": True,
                                              "--tensor-model-parallel-size": 1}, lambda d: None)
    args = _parse(_args(job_dir))
    # S1: the model is set up from --load, an HF directory slime reads itself (no --ref-load needed, none for SAO)
    (load,) = args["--load"]
    assert Path(load, "config.json").exists() and args["--hf-checkpoint"] == [load]
    assert json.loads(Path(load, "config.json").read_text())["model_type"] in slime_args.HF_MODEL_TYPES
    assert "--ref-load" not in args
    # S2: the one rollout saves, so --save-hf is written; the Megatron save goes inside the job directory
    num_rollout, interval = int(args["--num-rollout"][0]), int(args["--save-interval"][0])
    assert num_rollout == 1 and _saves(0, interval, num_rollout)
    assert args["--save-hf"] == [str(job_dir / "checkpoint")]
    assert Path(args["--save"][0]).parent == job_dir
    assert args["--loss-type"] == (["custom_loss"] if family == "sao" else ["policy_loss"])


# --------------------------------------------------------------------------- the fake follows train.py


def test_the_fake_is_named_as_one_and_says_which_slime_it_follows():
    assert fake_slime.__doc__.lstrip().startswith("FakeSlime: a FAKE")
    assert fake_slime.SLIME_COMMIT == slime_args.SLIME_COMMIT and slime_args.SLIME_COMMIT in fake_slime.__doc__


def test_the_fake_fails_like_slimes_model_set_up_without_load_or_ref_load(tok, tmp_path):
    def driver(job_dir):
        _edit_args(job_dir, lambda a: _without(a, "--load"))
        with pytest.raises(AssertionError, match=r"args\.load is not None"):
            fake_slime.run_job(job_dir)

    job_dir = _job(tok, tmp_path, fake_slime.ReinforceObjective(), {}, driver)
    assert m.read_marker(job_dir)["phase"] == m.RUNNING and not (job_dir / "checkpoint").exists()


def test_the_fake_falls_back_to_ref_load_for_an_hf_directory_slime_cannot_read(tok, tmp_path):
    """slime reads ``--load`` as HF only for its loaders' model types; otherwise ``--load`` becomes ``--ref-load``."""
    def driver(job_dir):
        other = tmp_path / "gpt2-like"
        load = _args(job_dir)[_args(job_dir).index("--load") + 1]
        shutil.copytree(load, other)
        config = json.loads((other / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
        _edit_args(job_dir, lambda a: [str(other) if x == load and a[i - 1] == "--load" else x
                                       for i, x in enumerate(a)])
        with pytest.raises(AssertionError, match=r"args\.load is not None"):
            fake_slime.run_job(job_dir)

    _job(tok, tmp_path, fake_slime.ReinforceObjective(), {}, driver)


def test_the_fake_writes_the_hf_checkpoint_only_when_save_interval_makes_it_save(tok, tmp_path):
    def driver(job_dir):
        _edit_args(job_dir, lambda a: _without(a, "--save-interval"))
        with pytest.raises(SystemExit, match="no model.safetensors and no shards"):
            fake_slime.run_job(job_dir)  # train.py trained and exited; finish finds nothing to hand back

    job_dir = _job(tok, tmp_path, fake_slime.ReinforceObjective(), {}, driver)
    assert not any((job_dir / "checkpoint").glob("*.safetensors"))
    assert m.read_marker(job_dir)["phase"] == m.RUNNING

    saved = _job(tok, tmp_path / "again", fake_slime.ReinforceObjective(), {}, fake_slime.run_job)
    assert m.read_marker(saved)["phase"] in (m.CHECKPOINT, m.UPDATING_WEIGHTS, m.READY_TO_COMMIT)
    assert (saved / "checkpoint.json").exists() and MODEL_FILE in json.loads((saved / "checkpoint.json").read_text())


def test_the_fake_ignores_an_unknown_flag_as_slime_does(tok, tmp_path):
    """slime parses with ``ignore_unknown_args=True``: a removed flag trains as if it were absent, which is why Reef
    refuses it at config load."""
    def driver(job_dir):
        _edit_args(job_dir, lambda a: a + ["--megatron-to-hf-mode", "raw"])
        fake_slime.run_job(job_dir)

    job_dir = _job(tok, tmp_path, fake_slime.ReinforceObjective(), {}, driver)
    assert (job_dir / "checkpoint.json").exists()


# --------------------------------------------------------------------------- the model slime can load


def test_trainer_build_refuses_a_base_model_slime_cannot_load(tok, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    context = SimpleNamespace(data_dir=tmp_path, engine=SimpleNamespace(model_dir=str(model_dir)), batch_size=None,
                              load_base_model=lambda: build_tiny_model(seed=0, tokenizer=tok),
                              load_reference_model=None, device="cpu")
    section = TrainerConfig(backend="slime", slime=SlimeConfig(launch=LAUNCH))
    with pytest.raises(ConfigError, match=r"model_type 'gpt2'.*--load"):
        SlimeTrainer.from_config(fake_slime.ReinforceObjective(), context, section, who="test")
    (model_dir / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert isinstance(SlimeTrainer.from_config(fake_slime.ReinforceObjective(), context, section, who="test"),
                      SlimeTrainer)
