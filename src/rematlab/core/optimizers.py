"""The optimizers a step can take, by name, and the one rematlab adds: AdamW with its state in
fp32 beside low-precision weights, the way large models are fine-tuned.

A model trained in bf16 loses small updates to rounding: mixed-precision training keeps an
fp32 master copy of each weight and AdamW's two moments in fp32, 12 bytes per trainable
parameter beside the 2 of the weight and the 2 of its gradient. `MixedAdamW` is that update,
parameter by parameter: the transient beyond its state is one fp32 gradient and one
denominator of the largest parameter, not a copy of them all. Applied to fp32 weights the
master copy is the weight itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from rematlab.exceptions import ConfigError

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "mixed-adamw")


def make_optimizer(name: str, params: Iterable[torch.Tensor], lr: float = 0.01,
                   foreach: bool | None = None) -> torch.optim.Optimizer:
    """`sgd` (plain), `momentum` (SGD, momentum 0.9: the default), `adam`, `adamw` (torch's:
    state in the weights' dtype) or `mixed-adamw` (state in fp32, `MixedAdamW`, one
    parameter at a time); `foreach` as torch's optimizers take it (None: torch's default for
    the parameters' device)."""
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=foreach)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=foreach)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr * 0.1, foreach=foreach)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr * 0.1, foreach=foreach)
    if name == "mixed-adamw":
        return MixedAdamW(params, lr=lr * 0.1)
    raise ConfigError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


class MixedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) on fp32 master weights and moments (module
    docstring)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["master"] = (p.detach().float().clone() if p.dtype != torch.float32
                                       else None)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                master = state["master"] if state["master"] is not None else p
                grad = p.grad.float()
                master.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                del grad
                bias1 = 1 - beta1 ** state["step"]
                bias2 = 1 - beta2 ** state["step"]
                denom = (state["exp_avg_sq"].sqrt() / math.sqrt(bias2)).add_(group["eps"])
                master.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / bias1)
                if master is not p:
                    p.copy_(master)
        return loss
