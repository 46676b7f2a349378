"""Gradient estimators behind one interface: backpropagation, forward-mode AD (forward
gradients) and zeroth-order SPSA with MeZO's seed trick (see `rematlab.gradients.comparison` for the
comparison that uses them).

Design note — the seed trick without drift. MeZO perturbs the weights in place
(θ += εz, θ -= 2εz, θ += εz), which restores θ only up to floating-point rounding. Here the
perturbation is applied per layer while that layer runs (its weights plus ε·z for that layer,
regenerated from the seed, then dropped): no copy of the parameters is made, at most one
layer's perturbation is alive, and the parameters are never written — they are restored
bit-exactly by construction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, jvp

from rematlab.exceptions import ConfigError

ModelLoss = Callable[[nn.Module], torch.Tensor]


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def direction(seed: int, index: int, like: torch.Tensor) -> torch.Tensor:
    """The seed trick: the same (seed, parameter index) always regenerates the same z."""
    gen = torch.Generator(device=like.device).manual_seed(seed * 1_000_003 + index)
    return torch.randn(like.shape, generator=gen, device=like.device, dtype=like.dtype)


@contextlib.contextmanager
def perturbed(model: nn.Module, seed: int, eps: float) -> Iterator[None]:
    """Run `model` as if every trainable parameter were θ + eps·z(seed); see module note."""
    index = {id(p): i for i, (_, p) in enumerate(trainable(model))}
    patched = []
    for module in model.modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        original = module.forward

        def forward(*args, _m=module, _own=own, _orig=original, **kwargs):
            shifted = {n: p + eps * direction(seed, index[id(p)], p) for n, p in _own}
            _m.forward = _orig
            try:
                return functional_call(_m, shifted, args, kwargs)
            finally:
                _m.forward = forward_ref[id(_m)]

        patched.append((module, original))
        module.forward = forward
    forward_ref = {id(m): m.forward for m, _ in patched}
    try:
        yield
    finally:
        for module, original in patched:
            module.forward = original


def zo_gradient(model: nn.Module, loss_fn: ModelLoss, k: int, eps: float, seed: int
                ) -> torch.Tensor:
    """Two-point SPSA averaged over k directions into `.grad`; returns the unperturbed loss
    estimate (mean of the two evaluations)."""
    params = trainable(model)
    for _, p in params:
        p.grad = torch.zeros_like(p)
    losses = []
    with torch.no_grad():
        for j in range(k):
            s = seed + j
            with perturbed(model, s, eps):
                plus = loss_fn(model)
            with perturbed(model, s, -eps):
                minus = loss_fn(model)
            proj = (plus - minus) / (2 * eps)
            for i, (_, p) in enumerate(params):
                p.grad.add_(direction(s, i, p), alpha=float(proj) / k)
            losses.append((plus + minus) / 2)
    return torch.stack(losses).mean()


def fmad_gradient(model: nn.Module, loss_fn: ModelLoss, k: int, seed: int) -> torch.Tensor:
    """Forward gradient averaged over k directions into `.grad` (torch.func.jvp)."""
    params = trainable(model)
    names = [n for n, _ in params]
    primals = tuple(p.detach() for _, p in params)
    for _, p in params:
        p.grad = torch.zeros_like(p)

    def f(*values: torch.Tensor) -> torch.Tensor:
        return loss_fn(_Bound(model, dict(zip(names, values, strict=True))))

    loss = torch.zeros(())
    for j in range(k):
        tangents = tuple(direction(seed + j, i, p) for i, p in enumerate(primals))
        loss, slope = jvp(f, primals, tangents)
        for (_, p), v in zip(params, tangents, strict=True):
            p.grad.add_(v, alpha=float(slope) / k)
    return loss.detach()


class _Bound(nn.Module):
    """`model` called with some parameters replaced (torch.func.functional_call)."""

    def __init__(self, model: nn.Module, values: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.model, self.values = model, values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, self.values, (x,))


def bp_gradient(model: nn.Module, loss_fn: ModelLoss) -> torch.Tensor:
    for _, p in trainable(model):
        p.grad = None
    loss = loss_fn(model)
    loss.backward()
    return loss.detach()


@dataclass(frozen=True)
class Method:
    """`bp`, `bp+ckpt[:STRATEGY]`, `fmad:K` or `zo:K`."""

    kind: str
    k: int = 1
    strategy: str = "sqrt"

    @classmethod
    def parse(cls, text: str) -> Method:
        kind, _, arg = text.partition(":")
        if kind == "bp" and not arg:
            return cls("bp")
        if kind == "bp+ckpt":
            return cls("bp+ckpt", strategy=arg or "sqrt")
        if kind in ("fmad", "zo"):
            try:
                k = int(arg or 1)
            except ValueError:
                raise ConfigError(f"method {text!r}: budget {arg!r} is not an integer") from None
            if k <= 0:
                raise ConfigError(f"method {text!r}: the budget must be positive")
            return cls(kind, k=k)
        raise ConfigError(f"unknown method {text!r}; use bp, bp+ckpt[:STRATEGY], fmad:K, zo:K")

    def __str__(self) -> str:
        if self.kind == "bp+ckpt":
            return f"bp+ckpt:{self.strategy}"
        return self.kind if self.kind == "bp" else f"{self.kind}:{self.k}"


def estimate(method: Method, model: nn.Module, loss_fn: ModelLoss, seed: int,
             eps: float = 1e-3) -> torch.Tensor:
    """Fill `.grad` of the trainable parameters with `method`'s estimate; return the loss."""
    if method.kind in ("bp", "bp+ckpt"):
        return bp_gradient(model, loss_fn)
    if method.kind == "fmad":
        return fmad_gradient(model, loss_fn, method.k, seed)
    return zo_gradient(model, loss_fn, method.k, eps, seed)
