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
    """A frozen linear layer (`nn.Linear` or transformers' `Conv1D`) plus a trainable
    low-rank update (alpha / rank)·B·A, B starting at zero so the adapted model starts as the
    base (alpha defaults to the rank: scale 1)."""

    def __init__(self, base: nn.Module, rank: int = 4, alpha: float | None = None) -> None:
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.scale = (alpha if alpha is not None else rank) / rank
        like = {"device": base.weight.device, "dtype": base.weight.dtype}
        fan_in, fan_out = features(base)
        self.a = nn.Parameter(torch.randn(rank, fan_in, **like) / math.sqrt(fan_in))
        self.b = nn.Parameter(torch.zeros(fan_out, rank, **like))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(x, self.a), self.b)
        return self.base(x) + (update if self.scale == 1 else self.scale * update)


def _conv1d() -> type | None:
    """transformers' `Conv1D` (GPT-2's projections: a linear layer whose weight is stored
    (in, out)), when transformers is installed."""
    if importlib.util.find_spec("transformers") is None:
        return None
    from transformers.pytorch_utils import Conv1D

    return Conv1D


def features(layer: nn.Module) -> tuple[int, int]:
    """A linear layer's (in, out) features: `nn.Linear`'s, or `Conv1D`'s transposed weight."""
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    return layer.weight.shape[0], layer.weight.shape[1]


def add_lora(model: nn.Module, rank: int = 16, alpha: float | None = None,
             targets: tuple[str, ...] = TARGETS) -> nn.Module:
    """`model` frozen, with LoRA adapters of `rank` on its linear layers named like one of
    `targets` (module docstring). Returns the model to train (peft wraps it)."""
    if rank < 1:
        raise ConfigError(f"a LoRA rank is at least 1, not {rank}")
    conv1d = _conv1d()
    linear = (nn.Linear, conv1d) if conv1d is not None else (nn.Linear,)
    found = {n: m for n, m in model.named_modules()
             if isinstance(m, linear) and n.rsplit(".", 1)[-1] in targets}
    names = list(found)
    if not names:
        raise ConfigError(f"{type(model).__name__} has no linear layer named like "
                          f"{', '.join(targets)}: nothing to adapt with LoRA")
    if importlib.util.find_spec("peft") is not None:
        from peft import LoraConfig, get_peft_model

        # Conv1D stores its weight transposed: peft's `fan_in_fan_out`, as for GPT-2
        transposed = any(not isinstance(m, nn.Linear) for m in found.values())
        config = LoraConfig(r=rank, lora_alpha=alpha or rank, target_modules=names,
                            fan_in_fan_out=transposed)
        return get_peft_model(model, config)
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        parent, _, child = name.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        setattr(holder, child, LoRALinear(getattr(holder, child), rank, alpha))
    return model
