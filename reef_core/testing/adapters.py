"""Test support: a random LoRA adapter for a model, in the shape the engines load."""

from __future__ import annotations

import copy


def random_adapter(base, seed: int):
    """A non-zero random LoRA adapter (r 4, every linear layer) for ``base``: ``(AdapterWeights, peft model)``,
    the second being ``base`` with the adapter applied by peft, for reference outputs."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from ..models.adapter import AdapterWeights

    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B starts at zero: a fresh adapter would change nothing
                p.normal_(0, 0.5)
    plain = {k: (v.value if hasattr(v, "value") else sorted(v) if isinstance(v, set) else v)
             for k, v in config.to_dict().items()}
    weights = AdapterWeights(plain, {k: v.clone() for k, v in get_peft_model_state_dict(model).items()})
    return weights, model.eval()
