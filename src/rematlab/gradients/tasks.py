"""The tasks and models of the gradient-estimator comparison: data shipped inside
scikit-learn (digits) or generated, the zoo's small models, and LoRA adapters for
fine-tuning a frozen backbone."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rematlab.core.lora import LoRALinear
from rematlab.core.steps import runs_on
from rematlab.exceptions import ConfigError
from rematlab.measurement import zoo


@dataclass
class Task:
    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    classes: int


def digits(image: bool = False, classes: tuple[int, ...] | None = None) -> Task:
    """scikit-learn's digits (8x8, shipped with the package): flattened, or 1x32x32 images."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    if classes is not None:
        keep = torch.isin(y, torch.tensor(classes))
        x, y = x[keep], y[keep]
    if image:
        x = F.interpolate(x.view(-1, 1, 8, 8), size=32, mode="bilinear", align_corners=False)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(x))
    tr, te = perm[:cut], perm[cut:]
    return Task("digits" + ("-img" if image else ""), x[tr], y[tr], x[te], y[te], 10)


def synthetic(n: int = 2000, features: int = 64, classes: int = 10, seed: int = 0) -> Task:
    """Labels from a random teacher MLP: a task of known difficulty, any size."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    teacher = torch.randn(features, classes, generator=g)
    y = torch.argmax(torch.tanh(x) @ teacher, dim=1)
    cut = int(0.8 * n)
    return Task("synthetic", x[:cut], y[:cut], x[cut:], y[cut:], classes)


def build_model(name: str) -> tuple[nn.Sequential, Task]:
    """Zoo models sized for the shipped data: MLPs on 64 digit pixels, LeNet-5 on 32x32."""
    if name in ("mlp3", "mlp5", "mlp7"):
        return zoo.mlp(int(name[3]), in_features=64, width=128), digits()
    if name == "lenet5":
        return zoo.lenet5(), digits(image=True)
    if name == "synthetic-mlp5":
        return zoo.mlp(5, in_features=64, width=128), synthetic()
    if ":" in name:
        model, _, _ = zoo.resolve(name, input_shape=(64,))
        task = digits()
        runs_on(model, model, task.x_train[:2], name)
        with torch.no_grad():
            shape = tuple(model(task.x_train[:2]).shape)
        if shape != (2, task.classes):
            raise ConfigError(f"{name} maps 64 inputs to {shape[1:]}, the task needs "
                              f"{task.classes} classes")
        return model, task
    raise ConfigError(f"unknown model {name!r} for the gradient comparison; use mlp3, mlp5, "
                      "mlp7, lenet5, synthetic-mlp5 or module:factory (64 inputs, 10 classes)")


def for_finetuning(model: nn.Sequential, classes: int, rank: int = 4) -> nn.Sequential:
    """Freeze everything, add LoRA adapters to hidden linear layers, new trainable head."""
    model = copy.deepcopy(model)
    for p in model.parameters():
        p.requires_grad_(False)
    linears = [(parent, name, m) for parent in model.modules()
               for name, m in parent.named_children() if isinstance(m, nn.Linear)]
    for parent, name, layer in linears[:-1]:
        setattr(parent, name, LoRALinear(layer, rank))
    parent, name, head = linears[-1]
    setattr(parent, name, nn.Linear(head.in_features, classes))
    return model
