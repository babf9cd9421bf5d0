"""OpenClaw's loss: the top-K OPD kernel, the PPO term, hint selection and a real step against the frozen base."""

from __future__ import annotations

import math

import pytest
import torch

from reef_core.api import ConfigError, TokenBatch, TokenRow, TorchTrainerOptions, TrainerSetup, build_tiny_model
from reef_openclaw.objective import (
    TEACHER_BASE,
    TEACHER_HINT,
    OpenClawObjective,
    clipped_surrogate,
    opd_advantages,
    select_teacher,
)
from reef_openclaw.trainer import OpenClawTrainer, hinted_messages

K = 4


def test_opd_advantage_never_exceeds_the_token_weight():
    gen = torch.Generator().manual_seed(0)
    old = torch.log_softmax(torch.randn(64, 50, generator=gen) * 3, dim=-1)[:, :K]
    teacher = torch.log_softmax(torch.randn(64, 50, generator=gen) * 3, dim=-1)[:, :K]
    for clip in (0.5, 1.0, 2.0):
        adv, weight = opd_advantages(teacher, old, clip)
        assert torch.allclose(weight.sum(-1), torch.ones(64))
        assert bool((adv.abs() <= clip * weight + 1e-7).all())
    adv, weight = opd_advantages(teacher, old, 1.0)
    assert bool((adv.abs() <= weight + 1e-7).all())
    assert bool((adv.abs() == weight).any())  # the clip binds somewhere in this draw


def test_opd_kernel_against_hand_computed_values():
    # two candidates, full-vocabulary probabilities 0.6 and 0.3 for the student, 0.3 and 0.6 for the teacher
    current = torch.log(torch.tensor([[0.6, 0.3]])).requires_grad_(True)
    teacher = torch.log(torch.tensor([[0.3, 0.6]]))
    adv, weight = opd_advantages(teacher, current, 1.0)
    assert torch.allclose(weight, torch.tensor([[2 / 3, 1 / 3]]))
    assert torch.allclose(adv, torch.tensor([[-math.log(2) * 2 / 3, math.log(2) / 3]]), atol=1e-6)
    ratio = torch.exp(current - current.detach())
    loss = clipped_surrogate(adv, ratio, 0.2, 0.28).sum()
    loss.backward()
    assert float(loss.detach()) == pytest.approx(math.log(2) / 3, abs=1e-6)  # (2/3)·ln 2 − (1/3)·ln 2
    assert torch.allclose(current.grad, -adv, atol=1e-6)  # d loss / d ℓ_v = −A_v at ρ = 1
    # a gap beyond adv_diff_clip is clipped: ℓ_T − ℓ_old = ln(100) → 1
    adv, weight = opd_advantages(torch.log(torch.tensor([[0.9, 0.5]])), torch.log(torch.tensor([[0.009, 0.5]])), 1.0)
    assert float(adv[0, 0]) == pytest.approx(float(weight[0, 0]))


def test_ppo_surrogate_is_pessimistic_outside_the_band():
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    ratio = torch.tensor([1.5, 0.5, 1.5, 0.5])
    out = clipped_surrogate(adv, ratio, 0.2, 0.28)
    assert torch.allclose(out, torch.tensor([-1.28, -0.5, 1.5, 0.8]))


def test_sequence_optimal_picks_the_candidate_with_the_most_overlap_and_ties_go_short():
    student = torch.tensor([[[1, 2, 3, 4], [5, 6, 7, 8]]])  # [B=1, L=2, K=4]
    mask = torch.ones(1, 2)
    a = torch.tensor([[[1, 2, 9, 9], [5, 9, 9, 9]]])  # overlap 2 + 1
    b = torch.tensor([[[1, 2, 3, 9], [9, 9, 9, 9]]])  # 3 + 0 (equal total: the shorter, a, wins)
    c = torch.tensor([[[9, 9, 9, 9], [5, 6, 7, 8]]])  # 0 + 4
    assert select_teacher(student, torch.stack([a, b, c]), mask, "sequence_optimal").tolist() == [2]
    assert select_teacher(student, torch.stack([a, b]), mask, "sequence_optimal").tolist() == [0]
    assert select_teacher(student, torch.stack([a, b, c]), mask, "token_optimal").tolist() == [[1, 2]]
    assert select_teacher(student, torch.stack([a, b, c]), mask, "shortest").tolist() == [0]
    absent = torch.full_like(c, -1)  # a row without a third candidate never picks it
    assert select_teacher(student, torch.stack([a, b, absent]), mask, "sequence_optimal").tolist() == [0]


def test_objective_validates_its_knobs():
    with pytest.raises(ConfigError, match="hint_selection"):
        OpenClawObjective(hint_selection="longest")
    with pytest.raises(ConfigError, match="eps_clip"):
        OpenClawObjective(eps_clip=1.0)
    with pytest.raises(ConfigError, match="adv_diff_clip"):
        OpenClawObjective(adv_diff_clip=0)
    with pytest.raises(ConfigError, match="w_opd"):
        OpenClawObjective(w_opd=float("nan"))


# -- real steps on the tiny model against the frozen base -------------------------------------------------------------


def _trainer(tok, lr=1e-2, **weights) -> OpenClawTrainer:
    setup = TrainerSetup(data_dir=None, load_base_model=lambda: build_tiny_model(seed=0, tokenizer=tok), seed=0)
    objective = OpenClawObjective(**weights)
    return OpenClawTrainer(objective, setup.load_base_model, TorchTrainerOptions(lr=lr, max_grad_norm=None))


def _rollout(trainer, tok, messages, n_tokens=6, seed=0):
    """Sample a reply from the policy with token ids, log-probs and top-K, as the local engine records them."""
    model = trainer.policy
    prompt = trainer._prompt_ids(messages)
    ids = list(prompt)
    gen = torch.Generator().manual_seed(seed)
    out, lps, top = [], [], {}
    with torch.no_grad():
        for j in range(n_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            logp = torch.log_softmax(logits, -1)
            token = int(torch.multinomial(logp.exp(), 1, generator=gen))
            values, index = logp.topk(K)
            top[len(prompt) + j] = (index.tolist(), values.tolist())
            out.append(token)
            lps.append(float(logp[token]))
            ids.append(token)
    return TokenRow(input_ids=prompt + out, action_mask=[0] * len(prompt) + [1] * n_tokens,
                    rollout_logprobs=[0.0] * len(prompt) + lps, reward=0.0, response_start=len(prompt), top_k=top)


def _batch(trainer, rows, teacher, hint_prompts):
    tb = TokenBatch.from_rows(rows, pad_token_id=trainer.pad_token_id)
    width = max([len(p) for ps in hint_prompts for p in ps] or [1])
    n = max([len(ps) for ps in hint_prompts] or [1]) or 1
    ids = torch.zeros((len(rows), n, width), dtype=torch.long)
    lens = torch.zeros((len(rows), n), dtype=torch.long)
    for b, ps in enumerate(hint_prompts):
        for h, p in enumerate(ps):
            ids[b, h, :len(p)] = torch.tensor(p)
            lens[b, h] = len(p)
    return tb.with_extras(openclaw_teacher=torch.tensor(teacher), openclaw_hint_ids=ids, openclaw_hint_lens=lens)


def _grad_norm(trainer, tb) -> float:
    prepared = trainer.objective.prepare(trainer.policy, tb)
    trainer.optimizer.zero_grad(set_to_none=True)
    loss, _ = trainer.objective.loss(trainer.policy, prepared.batch, prepared)
    loss.backward()
    grads = [p.grad.abs().max() for p in trainer.policy.parameters() if p.grad is not None]
    trainer.optimizer.zero_grad(set_to_none=True)
    return float(max(grads)) if grads else 0.0, prepared


PROMPT = [{"role": "user", "content": "What is the answer?"}]


def test_opd_gives_exactly_zero_gradient_when_the_teacher_is_the_student(tok):
    trainer = _trainer(tok, w_rl=0.0, w_opd=1.0)
    rows = [_rollout(trainer, tok, PROMPT, seed=s) for s in range(3)]
    # the anchor teacher (the frozen base after the plain prompt) equals the untrained student
    norm, prepared = _grad_norm(trainer, _batch(trainer, rows, [TEACHER_BASE] * 3, [[], [], []]))
    assert prepared.metrics["opd/rows"] == 3 and prepared.metrics["opd/tokens"] == 18
    assert norm == 0.0
    # a hinted teacher differs from the student: the same rows now carry a gradient
    hint = trainer._prompt_ids(hinted_messages(PROMPT, "Answer with the word yes."))
    norm, prepared = _grad_norm(trainer, _batch(trainer, rows, [TEACHER_HINT] * 3, [[hint]] * 3))
    assert prepared.metrics["opd/rows_hint"] == 3 and norm > 0.0


def test_a_step_moves_the_student_toward_the_hinted_teacher(tok):
    trainer = _trainer(tok, lr=3e-4, w_rl=0.0, w_opd=1.0)
    hint = trainer._prompt_ids(hinted_messages(PROMPT, "Answer with the word yes."))
    rows = [_rollout(trainer, tok, PROMPT, seed=s) for s in range(4)]
    tb = _batch(trainer, rows, [TEACHER_HINT] * 4, [[hint]] * 4)

    def gap():
        prepared = trainer.objective.prepare(trainer.policy, tb)
        with torch.no_grad():
            _, sums = trainer.objective.loss(trainer.policy, prepared.batch, prepared)
        return sums["opd_adv_abs_sum"] / sums["opd_tokens"]  # mean of Σ_v |A_v|: the clipped, weighted gap

    before = gap()
    for _ in range(5):
        update = trainer.step(tb)
    assert update is not None and update.metrics["opd/rows"] == 4 and "opd_teacher_gap_mean" in update.metrics
    after = gap()
    assert after < 0.5 * before, (before, after)


def test_rl_term_raises_rewarded_tokens_and_lowers_punished_ones(tok):
    trainer = _trainer(tok, w_rl=1.0, w_opd=0.0)
    good, bad = _rollout(trainer, tok, PROMPT, seed=1), _rollout(trainer, tok, PROMPT, seed=2)
    good.reward, bad.reward = 1.0, -1.0
    tb = _batch(trainer, [good, bad], [0, 0], [[], []])

    def logps():
        with torch.no_grad():
            from reef_core.api import sequence_logprobs

            lp = sequence_logprobs(trainer.policy, tb)
        return [float((lp[b] * tb.action_mask[b]).sum()) for b in range(2)]

    before = logps()
    update = trainer.step(tb)
    after = logps()
    assert update.metrics["loss_opd"] == 0.0
    assert after[0] > before[0] and after[1] < before[1]


def test_control_arm_has_no_gradient(tok):
    trainer = _trainer(tok, w_rl=0.0, w_opd=0.0)
    row = _rollout(trainer, tok, PROMPT)
    row.reward = 1.0
    hint = trainer._prompt_ids(hinted_messages(PROMPT, "Answer with the word yes."))
    norm, _ = _grad_norm(trainer, _batch(trainer, [row], [TEACHER_HINT], [[hint]]))
    assert norm == 0.0


def test_hinted_messages_append_to_the_last_user_message():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "q2"}]}]
    out = hinted_messages(messages, "Be brief.")
    assert out[3]["content"] == "q2\n\n[user's hint / instruction]\nBe brief." and out[1]["content"] == "q1"
    assert messages[3]["content"] == [{"type": "text", "text": "q2"}]  # the input is left alone
    assert hinted_messages([{"role": "system", "content": "s"}], "Be brief.") is None


def test_with_lora_the_teacher_is_the_adapter_free_base(tok):
    setup = TrainerSetup(data_dir=None, load_base_model=lambda: build_tiny_model(seed=0, tokenizer=tok), seed=0)
    trainer = OpenClawTrainer(OpenClawObjective(w_rl=1.0, w_opd=1.0), setup.load_base_model,
                              TorchTrainerOptions(lr=1e-2, lora=True, lora_rank=4, max_grad_norm=None))
    hint = trainer._prompt_ids(hinted_messages(PROMPT, "Answer with the word yes."))
    rows = [_rollout(trainer, tok, PROMPT, seed=s) for s in range(2)]
    rows[0].reward, rows[1].reward = 1.0, -1.0
    tb = _batch(trainer, rows, [TEACHER_HINT, TEACHER_BASE], [[hint], []])
    before = trainer.reference.score(tb, token_ids=tb.top_k_ids).token_logprobs
    for _ in range(3):
        update = trainer.step(tb)
    assert update is not None and update.metrics["opd/rows"] == 2
    after = trainer.reference.score(tb, token_ids=tb.top_k_ids).token_logprobs
    assert torch.equal(before, after)  # training the adapter never moves the teacher


def test_sequence_optimal_prefers_the_candidate_whose_top_k_matches_the_student(tok):
    trainer = _trainer(tok, w_rl=0.0, w_opd=1.0)
    rows = [_rollout(trainer, tok, PROMPT, seed=s) for s in range(2)]
    plain = rows[0].input_ids[:rows[0].response_start]  # a "hint" that changes nothing: the student's own context
    other = trainer._prompt_ids(hinted_messages(PROMPT, "Reply with a long list of city names, one per line."))
    batch = _batch(trainer, rows, [TEACHER_HINT] * 2, [[other, plain]] * 2)
    prepared = trainer.objective.prepare(trainer.policy, batch)
    assert prepared.metrics["opd/hint_index_mean"] == 1.0
    trainer.objective.hint_selection = "shortest"
    prepared = trainer.objective.prepare(trainer.policy, batch)
    assert prepared.metrics["opd/hint_index_mean"] == 0.0
