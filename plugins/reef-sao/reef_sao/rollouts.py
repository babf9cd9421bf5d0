"""Local rollouts with token capture, the way Reef's LocalEngine records them (offline runs and tests).

For each chat: ``prompt_ids`` is the chat template rendered with ``add_generation_prompt`` and tokenized without
special tokens; tokens are sampled from ``softmax(logits / temperature)``; ``output_logprobs[i]`` is the token's
log-probability under the model's *raw* temperature-1 distribution, ``log_softmax(logits)[token]``; generation ends
at an end-of-sequence token (kept in ``output_ids``, not in the text) or at ``max_new_tokens``.

Several chats are sampled as one left-padded batch (position ids follow the padding), which gives the same
distribution as one chat at a time, up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class Rollout:
    """One sampled completion and the token data a training sample needs."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    text: str

    def tokens(self, version: str | None = "base") -> dict:
        """The ``tokens`` dict of an inference record (``TokenData.to_dict()`` form)."""
        return {"prompt_ids": list(self.prompt_ids), "output_ids": list(self.output_ids),
                "output_logprobs": list(self.output_logprobs), "version": version}


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the chat prompt exactly as LocalEngine renders it."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _eos_ids(model, tokenizer) -> set[int]:
    eos: set[int] = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            eos.add(source)
        elif isinstance(source, (list, tuple)):
            eos.update(int(x) for x in source)
    return eos


@torch.no_grad()
def sample_rollouts(model, tokenizer, chats: Sequence[list[dict]], *, max_new_tokens: int = 8,
                    temperature: float = 1.0, generator: torch.Generator | None = None) -> list[Rollout]:
    """Sample one completion per chat (see the module docstring)."""
    if not chats:
        return []
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    prompts = [prompt_ids(tokenizer, list(chat)) for chat in chats]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    eos = _eos_ids(model, tokenizer)
    outputs: list[list[int]] = [[] for _ in prompts]
    logps: list[list[float]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for _ in range(max_new_tokens):
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits[:, -1]
        logits = logits.float()
        raw = torch.log_softmax(logits, dim=-1)
        if temperature <= 0:
            picked = logits.argmax(dim=-1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            picked = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        for i, tid in enumerate(picked.tolist()):
            if done[i]:
                continue
            outputs[i].append(tid)
            logps[i].append(float(raw[i, tid]))
            if tid in eos:
                done[i] = True
        if all(done):
            break
        ids = torch.cat([ids, picked.unsqueeze(1)], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    if was_training:
        model.train()
    rollouts = []
    for p, out, lp in zip(prompts, outputs, logps):
        text_ids = [t for t in out if t not in eos]
        rollouts.append(Rollout(p, out, lp, tokenizer.decode(text_ids, skip_special_tokens=True)))
    return rollouts
