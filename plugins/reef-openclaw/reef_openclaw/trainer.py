"""The ``openclaw`` trainer: validated options → :class:`~reef_openclaw.objective.OpenClawObjective` → a torch trainer.

:class:`OpenClawTrainer` is Reef's :class:`~reef_core.api.TorchTrainer` plus one thing: when it turns samples into a
token batch it attaches what the teacher needs per row (``batch.extras``): which teacher the judge's dispatch chose
(``metadata["openclaw"]["teacher"]``: ``hint`` or ``base``; a sample without it, e.g. from an explicit report, gets
the plain-prompt anchor when its reward is non-zero) and, for hinted rows, the token ids of every hinted prompt: the
sample's prompt with ``"\\n\\n[user's hint / instruction]\\n" + hint`` appended to its last user message, rendered with
the tokenizer's chat template as the local engine renders prompts (without the request's tools, which a sample does
not keep).
"""

from __future__ import annotations

import copy

import torch

from reef_core.api import ConfigError, RecipeConfig, TokenBatch, TorchTrainer, TrainerConfig, TrainerSetup, \
    content_text

from reef_openclaw.objective import TEACHER_BASE, TEACHER_HINT, TEACHER_NONE, OpenClawObjective
from reef_openclaw.options import OpenClawOptions

#: What separates the user's message from the hint in the teacher's prompt (upstream's wording).
HINT_PREFIX = "\n\n[user's hint / instruction]\n"


def hinted_messages(messages: list[dict], hint: str) -> list[dict] | None:
    """``messages`` with ``HINT_PREFIX + hint`` appended to the last user message; None without a user message."""
    out = copy.deepcopy(list(messages))
    for message in reversed(out):
        if message.get("role") == "user":
            message["content"] = content_text(message.get("content"), non_text="skip") + HINT_PREFIX + hint
            return out
    return None


class OpenClawTrainer(TorchTrainer):
    """A :class:`TorchTrainer` whose batches carry the teacher's per-row inputs (see the module docstring)."""

    def _prompt_ids(self, messages: list[dict]) -> list[int]:
        tok = self.tokenizer
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def token_batch(self, samples: list) -> TokenBatch:
        tb = super().token_batch(samples)
        teacher = torch.zeros(tb.size, dtype=torch.long)
        prompts: list[list[list[int]]] = []
        for b, sample in enumerate(samples):
            info = (sample.metadata or {}).get("openclaw") or {}
            kind = info.get("teacher")
            rows: list[list[int]] = []
            if kind == "hint":
                for hint in info.get("hints") or []:
                    messages = hinted_messages(sample.prompt, str(hint))
                    if messages is not None:
                        rows.append(self._prompt_ids(messages))
                teacher[b] = TEACHER_HINT if rows else TEACHER_NONE
            elif kind == "base" or (kind is None and float(sample.reward or 0.0) != 0.0):
                teacher[b] = TEACHER_BASE
            prompts.append(rows)
        width = max([len(p) for rows in prompts for p in rows] or [1])
        n_hints = max([len(rows) for rows in prompts] or [1]) or 1
        ids = torch.zeros((tb.size, n_hints, width), dtype=torch.long)
        lens = torch.zeros((tb.size, n_hints), dtype=torch.long)
        for b, rows in enumerate(prompts):
            for h, p in enumerate(rows):
                ids[b, h, :len(p)] = torch.tensor(p, dtype=torch.long)
                lens[b, h] = len(p)
        device = tb.device
        return tb.with_extras(openclaw_teacher=teacher.to(device), openclaw_hint_ids=ids.to(device),
                              openclaw_hint_lens=lens.to(device))


def make_openclaw_trainer(*, scenario: str, recipe: RecipeConfig, trainer: TrainerConfig, context: TrainerSetup,
                          **_extra) -> OpenClawTrainer:
    """Build the OpenClaw-RL trainer for one scenario."""
    opts = OpenClawOptions.from_options(recipe.options, recipe.processor_options)
    if trainer.grad_accumulation < 1 or opts.batch_size % trainer.grad_accumulation:
        raise ConfigError(f"openclaw: batch_size {opts.batch_size} must be a multiple of trainer.grad_accumulation "
                          f"{trainer.grad_accumulation} (equal micro-batches; one optimizer step per batch)")
    objective = OpenClawObjective(w_rl=opts.w_rl, w_opd=opts.w_opd, eps_clip=opts.eps_clip,
                                  eps_clip_high=opts.eps_clip_high, adv_diff_clip=opts.adv_diff_clip,
                                  hint_selection=opts.hint_selection)
    return OpenClawTrainer.from_config(
        objective, context, trainer, who="openclaw",
        weight_decay=opts.weight_decay, betas=(0.9, opts.adam_beta2), max_grad_norm=opts.max_grad_norm,
        lag_metric_prefix="openclaw/", name="openclaw" if opts.w_rl or opts.w_opd else "openclaw-control",
    )
