"""reef_slime_hooks: each loss family's slime hook gives Reef's own objective loss and gradient on the same batch.

The hook runs on slime's data path as :mod:`reef_core.testing.slime_batch` fakes it on one rank: the rollout file Reef
writes for the job, ``reef_advantages`` filling ``rollout_data["advantages"]``, micro-batches of per-sample lists,
packed logits, slime's reducer with ``--calculate-per-token-loss`` and Megatron's division by the step's tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import reef_slime_hooks as hooks
from reef_core.config.schema import SlimeConfig, TrainerConfig
from reef_core.errors import ConfigError
from reef_core.models.loading import build_tiny_model
from reef_core.grow.objective import Prepared, sequence_logprobs
from reef_core.grow.slime import jobs
from reef_core.grow.slime.flags import job_argv
from reef_core.grow.slime.learner_side import loss_header, token_advantages
from reef_core.grow.slime.trainer import SlimeTrainer
from reef_core.grow.token_batch import TokenBatch, TokenRow
from reef_core.grow.torch_backend import TorchTrainer, TorchTrainerOptions
from reef_core.grow.trainer import TrainerSetup
from reef_core.testing import fake_slime, slime_batch
from reef_openclaw.objective import OpenClawObjective
from reef_sao.objectives import DISObjective, GRPODISObjective, SAOObjective
from reef_ttt.objective import TTTObjective

from .test_slime_backend import LAUNCH, CommitLog, _batch

#: Tiny models run fastest single-threaded (intra-op threads mostly wait on each other).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tok):
    m, _ = build_tiny_model(seed=0, tokenizer=tok)
    return m.eval()


def _token_batch(model) -> TokenBatch:
    """Four rows, two groups; one multi-turn row with observation tokens inside its response; rollout log-probs
    off the model's by up to ±0.6 so some tokens leave the clip bands."""
    specs = [([5, 6, 7], [40, 41, 42, 43], [1, 1, 1, 1], 1.0, "g1"),
             ([5, 8], [44, 45, 46], [1, 1, 1], -0.5, "g1"),
             ([9, 6, 7, 10], [47, 48, 49, 50, 51], [1, 1, 0, 0, 1], 0.25, "g2"),
             ([11, 12], [52, 53], [1, 1], 2.0, "g2")]
    rows = []
    for prompt, out, action, reward, group in specs:
        rows.append(TokenRow(input_ids=prompt + out, action_mask=[0] * len(prompt) + action,
                             rollout_logprobs=[0.0] * (len(prompt) + len(out)), reward=reward,
                             response_start=len(prompt), group_key=group))
    tb = TokenBatch.from_rows(rows)
    with torch.no_grad():
        actual = sequence_logprobs(model, tb)
    g = torch.Generator().manual_seed(7)
    noise = (torch.rand(actual.shape, generator=g) - 0.5) * 1.2
    tb.rollout_logprobs = torch.where(tb.action_mask > 0, actual + noise, torch.zeros_like(actual))
    return tb


class _Reference:
    """The frozen base for TTT's KL term: another tiny model."""

    def __init__(self, tok):
        self.model = build_tiny_model(seed=1, tokenizer=tok)[0].eval()

    def logprobs(self, batch):
        with torch.no_grad():
            return sequence_logprobs(self.model, batch)


def _prepared(family: str, model, tok, tb: TokenBatch):
    if family == "dis":
        objective = DISObjective(eps_clip=0.2, eps_clip_high=0.3)
        adv = torch.randn(tb.input_ids.shape, generator=torch.Generator().manual_seed(3)) * tb.action_mask
        return objective, Prepared(batch=tb.with_extras(advantages=adv))
    if family == "sao":
        objective = SAOObjective(eps_clip=0.2, eps_clip_high=0.3, critic_steps_per_actor=1, num_critic_only_steps=0)
        objective.setup(model, tok, torch.device("cpu"))
    elif family == "sao-grpo-dis":
        objective = GRPODISObjective(eps_clip=0.2, eps_clip_high=0.3, group_size=2)
        objective.setup(model, tok, torch.device("cpu"))
    elif family == "ttt":
        tb.group_keys = ["g"] * tb.size  # one group of 4 (the entropic β of a pair of rollouts is degenerate)
        objective = TTTObjective(kl_coef=0.1)
        objective.setup(model, tok, torch.device("cpu"), reference=_Reference(tok))
    else:
        objective = OpenClawObjective(w_rl=0.7, w_opd=0.0, eps_clip=0.2, eps_clip_high=0.28)
        objective.setup(model, tok, torch.device("cpu"), reference=None)
    return objective, objective.prepare(model, tb)


HOOK = {"dis": hooks.dis_loss, "sao": hooks.sao_loss, "sao-grpo-dis": hooks.grpo_dis_loss, "ttt": hooks.ttt_loss,
        "openclaw": hooks.openclaw_loss}


def _grads(model, loss) -> list[torch.Tensor]:
    params = [p for p in model.parameters()]
    return [g if g is not None else torch.zeros_like(p)
            for g, p in zip(torch.autograd.grad(loss, params, allow_unused=True), params)]


@pytest.mark.parametrize("family", sorted(HOOK))
def test_the_hook_gives_the_objectives_loss_and_gradient(family, model, tok, tmp_path):
    tb = _token_batch(model)
    objective, prepared = _prepared(family, model, tok, tb)
    assert objective.name == family
    reef_loss, _ = objective.loss(model, prepared.batch, prepared)
    reef_grads = _grads(model, reef_loss)

    path = tmp_path / "rollout.pt"
    samples = jobs.slime_samples(tb, token_advantages(objective, prepared))
    torch.save({"rollout_id": 0, "samples": samples, "reef": loss_header(objective, prepared.batch)}, path)
    args = slime_batch.job_args(str(path))
    data = slime_batch.rollout_data(torch.load(path, weights_only=False)["samples"])
    hooks.reef_advantages(args, data)
    assert [a.shape[0] for a in data["advantages"]] == data["response_lengths"]
    total = 0
    for rows in ([0, 1], [2, 3]):  # two micro-batches: Megatron sums them, then divides by the step's tokens
        micro = slime_batch.micro_batch(data, rows)
        loss, log = HOOK[family](args, micro, slime_batch.packed_logits(model, micro),
                                 slime_batch.sum_of_sample_mean(micro))
        assert "loss" in log and all(v.dim() == 0 for v in log.values())
        total = total + loss
    hook_loss = total / slime_batch.step_tokens(data)
    assert abs(float(hook_loss.detach()) - float(reef_loss.detach())) < 1e-5, (float(hook_loss), float(reef_loss))
    assert float(reef_loss.detach()) != 0.0
    # 1e-5 absolute, scaled by the gradient's size (TTT's token sum gives gradients far above 1: float32 rounding)
    scale = max(1.0, max(float(g.abs().max()) for g in reef_grads))
    for a, b in zip(_grads(model, hook_loss), reef_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * scale)
    assert any(float(g.abs().max()) > 1e-4 for g in reef_grads)


def test_a_hook_refuses_another_familys_job(model, tok, tmp_path):
    tb = _token_batch(model)
    objective, prepared = _prepared("sao-grpo-dis", model, tok, tb)
    path = tmp_path / "rollout.pt"
    torch.save({"rollout_id": 0, "samples": jobs.slime_samples(tb, token_advantages(objective, prepared)),
                "reef": loss_header(objective, prepared.batch)}, path)
    data = slime_batch.rollout_data(torch.load(path, weights_only=False)["samples"])
    args = slime_batch.job_args(str(path))
    hooks.reef_advantages(args, data)
    micro = slime_batch.micro_batch(data)
    with pytest.raises(ValueError, match="family 'sao-grpo-dis'"):
        hooks.ttt_loss(args, micro, slime_batch.packed_logits(model, micro), slime_batch.sum_of_sample_mean(micro))


def test_importing_the_hooks_loads_nothing_of_reef_core():
    code = ("import sys, reef_slime_hooks; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('reef_core', 'transformers', 'slime')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(hooks.__file__).parent)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_loss_terms_the_hooks_share_import_only_torch_and_the_standard_library():
    """reef_slime_hooks loads reef_core/grow/losses.py from its file inside slime's processes (no reef_core package
    there): the module the torch backend's objectives use is the one the hooks run."""
    import ast

    from reef_core.grow import losses

    assert hooks.losses.__file__ == losses.__file__
    tree = ast.parse(Path(losses.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "math", "torch"}, imported
    for name in ("gather_logprobs", "dis_weight", "clipped_surrogate"):
        assert getattr(hooks.losses, name).__code__.co_filename == getattr(losses, name).__code__.co_filename


def test_a_custom_family_job_names_the_hooks_and_the_per_token_loss():
    argv = job_argv(SAOObjective.slime_loss, {"--global-batch-size": 4}, lr=1e-6, rollout="r.pt", hf_in="i",
                    hf_out="o", save="m", samples=4)
    pairs = dict(zip(argv, argv[1:]))
    assert pairs["--custom-loss-function-path"] == "reef_slime_hooks.sao_loss"
    assert pairs["--custom-advantage-function-path"] == "reef_slime_hooks.reef_advantages"
    assert "--use-rollout-logprobs" in argv and "--calculate-per-token-loss" in argv
    assert "--disable-compute-advantages-and-returns" not in argv
    for objective in (DISObjective, GRPODISObjective, OpenClawObjective, TTTObjective):
        a = job_argv(objective.slime_loss, {}, lr=1.0, rollout="r", hf_in="i", hf_out="o", save="m", samples=1)
        path = dict(zip(a, a[1:]))
        module, _, fn = path["--custom-loss-function-path"].partition(".")
        assert module == "reef_slime_hooks" and callable(getattr(hooks, fn))


def _setup(tok, tmp_path, batch_size=None) -> TrainerSetup:
    return TrainerSetup(data_dir=tmp_path, load_base_model=lambda: build_tiny_model(seed=0, tokenizer=tok),
                        batch_size=batch_size)


def test_trainer_build_refuses_a_global_batch_size_other_than_the_recipes(tok, tmp_path):
    objective = GRPODISObjective(eps_clip=0.2, eps_clip_high=0.3, group_size=2)
    section = TrainerConfig(backend="slime", slime=SlimeConfig(launch=LAUNCH, flags={"--global-batch-size": 8}))
    with pytest.raises(ConfigError, match=r"--global-batch-size 8 differs from the recipe's batch size 4"):
        TorchTrainer.from_config(objective, _setup(tok, tmp_path, 4), section, who="test")
    assert isinstance(TorchTrainer.from_config(objective, _setup(tok, tmp_path, 8), section, who="test"), SlimeTrainer)
    fixed = TrainerConfig(backend="slime", slime=SlimeConfig(launch=LAUNCH, flags={"--eps-clip": 0.1}))
    with pytest.raises(ConfigError, match="--eps-clip cannot be set for the loss family 'sao-grpo-dis'"):
        TorchTrainer.from_config(objective, _setup(tok, tmp_path), fixed, who="test")
    with pytest.raises(ConfigError, match="OPD term"):
        TorchTrainer.from_config(OpenClawObjective(w_opd=1.0), _setup(tok, tmp_path),
                                 TrainerConfig(backend="slime", slime=SlimeConfig(launch=LAUNCH)), who="test")


def test_a_batch_of_another_size_than_the_global_batch_size_launches_no_job(tok, tmp_path):
    t = SlimeTrainer(GRPODISObjective(eps_clip=0.2, eps_clip_high=0.3, group_size=2), launch=LAUNCH,
                     flags={"--global-batch-size": 8}, jobs_dir=tmp_path, timeout_s=120, lr=1e-2,
                     load_base_model=lambda: build_tiny_model(seed=0, tokenizer=tok), device="cpu")
    with pytest.raises(ConfigError, match="--global-batch-size 8 differs from this batch's 4 samples"):
        t.train(_batch(4), CommitLog().ctx())
    assert t.launched == 0 and not list(tmp_path.rglob("job.json"))


def test_the_learners_batch_size_comes_from_the_processor_options():
    from types import SimpleNamespace

    from reef_core.loop.learner import _batch_size

    assert _batch_size(SimpleNamespace(processor_options={"batch_size": 6})) == 6
    assert _batch_size(SimpleNamespace(processor_options={"group_size": 4, "groups_per_batch": 2})) == 8
    assert _batch_size(SimpleNamespace(processor_options={"groups": 3, "rollouts_per_group": 2})) == 6
    assert _batch_size(SimpleNamespace(processor_options={})) is None


def test_an_sao_step_through_the_fake_job_equals_the_torch_backends(tok, tmp_path):
    """SAO end to end: the learner's critic step and GAE, the advantages in the rollout file, the fake job training
    through reef_slime_hooks.sao_loss; weights and critic equal the torch backend's step on the same batch."""
    def sao():
        # a wide band: the fake batch's rollout log-probs (-2.0) are far from the tiny model's
        return SAOObjective(eps_clip=0.99, eps_clip_high=50.0, critic_steps_per_actor=1, num_critic_only_steps=0)

    def load():
        return build_tiny_model(seed=0, tokenizer=tok)

    batch = _batch(4)
    torch_trainer = TorchTrainer(sao(), load,
                                 TorchTrainerOptions(lr=1e-2, device="cpu", seed=3, export_objective_state=True))
    expected = torch_trainer.step(TokenBatch.from_samples(batch.samples))

    t = SlimeTrainer(sao(), launch=LAUNCH, flags={"--seed": 3, "--global-batch-size": 4}, jobs_dir=tmp_path,
                     timeout_s=120, lr=1e-2, load_base_model=load, device="cpu")
    t.run_driver = fake_slime.run_job
    log = CommitLog()
    update = t.train(batch, log.ctx())
    job = json.loads(next(tmp_path.rglob("job.json")).read_text())
    assert job["objective_json_state"]["actor_steps"] == 1
    assert "critic/loss" in update.metrics and update.algorithm_state["objective"] == "sao"
    got = {k: v for k, v in update.payload.items()}
    for k, v in expected.payload.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-5)
    assert any((got[k] != v).any() for k, v in load()[0].state_dict().items() if k in got)
    from safetensors.torch import load as load_st

    critic = load_st(bytes(update.files["algorithm/sao.safetensors"]))
    expected_critic = load_st(bytes(expected.files["algorithm/sao.safetensors"]))
    for k, v in expected_critic.items():
        torch.testing.assert_close(critic[k], v, rtol=0, atol=1e-6)
    t.accepted(update, log.commit(update, batch))
    rollout_gone = not any(tmp_path.rglob("rollout.pt"))
    assert rollout_gone


def test_an_adopted_sao_job_brings_the_critic_its_step_trained(tok, tmp_path, monkeypatch):
    """Reef dies after the job's checkpoint: a restarted trainer adopts it without training or preparing again, and
    the candidate carries the critic and counters of the step that produced it."""
    from reef_core.grow.slime import trainer as slime_trainer

    from .test_slime_backend import Crash, _crash_at

    def make():
        t = SlimeTrainer(SAOObjective(eps_clip=0.99, eps_clip_high=50.0, critic_steps_per_actor=1,
                                      num_critic_only_steps=0),
                         launch=LAUNCH, flags={"--seed": 3}, jobs_dir=tmp_path, timeout_s=120, lr=1e-2,
                         load_base_model=lambda: build_tiny_model(seed=0, tokenizer=tok), device="cpu")
        t.run_driver = fake_slime.run_job
        return t

    log, batch = CommitLog(), _batch(2)
    first = make()
    _crash_at(monkeypatch, "slime_ready_to_commit")
    with pytest.raises(Crash):
        first.train(batch, log.ctx())
    monkeypatch.setattr(slime_trainer, "crash_point", lambda at: None)
    critic_then = {k: v.clone() for k, v in first.objective.state_dict().items()}
    assert float(critic_then["head.weight"].abs().sum()) > 0  # the step's critic update, not the fresh critic
    again = make()
    update = again.train(batch, log.ctx())
    assert again.launched == 0 and update.algorithm_state["objective_state"]["actor_steps"] == 1
    from safetensors.torch import load as load_st

    carried = load_st(bytes(update.files["algorithm/sao.safetensors"]))
    for k, v in critic_then.items():
        torch.testing.assert_close(carried[k], v, rtol=0, atol=0)
        torch.testing.assert_close(again.objective.state_dict()[k], v, rtol=0, atol=0)
    assert again.objective.actor_steps == 1
