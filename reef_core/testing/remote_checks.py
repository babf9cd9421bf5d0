"""Checks shared by the tests of the HTTP serving engines (SGLang, vLLM) against their fakes: the log-probs a real
forward pass gives recorded tokens, moved weights, random LoRA adapters and a base model with one merged in."""

from __future__ import annotations

import copy

import torch

from reef_core.models.adapter import AdapterWeights


def reference_logprobs(model, prompt_ids: list[int], output_ids: list[int]):
    """(log-prob of each output token, the full log-softmax rows) under ``model`` at temperature 1."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)
    return lp[torch.arange(len(output_ids)), torch.tensor(output_ids)], lp


def perturbed(model, seed: int) -> dict:
    """A full state dict of moved weights (through the parameters, so tied tensors stay tied)."""
    moved = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moved.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return {k: v.clone() for k, v in moved.state_dict().items()}


def random_adapter(base, seed: int, rank: int = 4) -> AdapterWeights:
    """A LoRA adapter over every linear layer of ``base`` whose B matrices are random (so it changes the model)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=8, target_modules="all-linear",
                                                                task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    config = {k: (v.value if hasattr(v, "value") else sorted(v) if isinstance(v, set) else v)
              for k, v in peft_model.peft_config["default"].to_dict().items()}
    return AdapterWeights(config, {k: v.clone() for k, v in get_peft_model_state_dict(peft_model).items()})


def with_adapter(base, adapter: AdapterWeights):
    """``base`` with ``adapter`` applied (a copy)."""
    from peft import PeftConfig, get_peft_model, set_peft_model_state_dict

    peft_model = get_peft_model(copy.deepcopy(base), PeftConfig.from_peft_type(**adapter.config))
    set_peft_model_state_dict(peft_model, dict(adapter.tensors))
    return peft_model.eval()
