"""LoRA adapters: a frozen model whose chosen linear layers learn a low-rank update.

Fine-tuning a large model with LoRA trains well under 1 % of its parameters: their gradients
and optimizer state are small, and the step's peak is the frozen weights plus the activations,
which is where checkpointing pays. `add_lora` adapts a model with the `peft` library when it is
installed (the adapters users train with), and with `LoRALinear` otherwise. Either works on a
model built on the meta device: the adapters are made where the weights are.
"""

from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F
from torch import nn

from rematlab.exceptions import ConfigError

# The projections LoRA adapts in the models users fine-tune: Llama, Qwen2, Mistral (q/k/v/o,
# gate/up/down), GPT-2 (c_attn, c_proj, c_fc), BERT (query, key, value, dense).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "c_attn", "c_proj", "c_fc", "query", "key", "value")


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (alpha / rank)·B·A, B starting
    at zero so the adapted model starts as the base (alpha defaults to the rank: scale 1)."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: float | None = None) -> None:
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.scale = (alpha if alpha is not None else rank) / rank
        like = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.a = nn.Parameter(torch.randn(rank, base.in_features, **like)
                              / math.sqrt(base.in_features))
        self.b = nn.Parameter(torch.zeros(base.out_features, rank, **like))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(x, self.a), self.b)
        return self.base(x) + (update if self.scale == 1 else self.scale * update)


def add_lora(model: nn.Module, rank: int = 16, alpha: float | None = None,
             targets: tuple[str, ...] = TARGETS) -> nn.Module:
    """`model` frozen, with LoRA adapters of `rank` on its linear layers named like one of
    `targets` (module docstring). Returns the model to train (peft wraps it)."""
    if rank < 1:
        raise ConfigError(f"a LoRA rank is at least 1, not {rank}")
    names = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in targets]
    if not names:
        raise ConfigError(f"{type(model).__name__} has no linear layer named like "
                          f"{', '.join(targets)}: nothing to adapt with LoRA")
    if importlib.util.find_spec("peft") is not None:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=rank, lora_alpha=alpha or rank, target_modules=names)
        return get_peft_model(model, config)
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        parent, _, child = name.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        setattr(holder, child, LoRALinear(getattr(holder, child), rank, alpha))
    return model
