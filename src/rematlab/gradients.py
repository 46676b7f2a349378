"""Backprop with checkpointing versus forward-mode AD and zeroth-order training.

One training loop, interchangeable gradient estimators, all feeding the same optimizer:

- `bp`: backpropagation;
- `bp+ckpt[:STRATEGY]`: backpropagation through `rematlab.apply(model, STRATEGY)` (sqrt);
- `fmad:K`: forward gradient, g = mean over K random directions v of (grad f . v) v, computed
  with `torch.func.jvp` — no activations are stored;
- `zo:K`: two-point SPSA, g = mean over K directions z of (f(θ+εz) - f(θ-εz)) / 2ε · z, with
  MeZO's seed trick: z is never stored, it is regenerated from a per-direction seed when needed.

Design note — the seed trick without drift. MeZO perturbs the weights in place
(θ += εz, θ -= 2εz, θ += εz), which restores θ only up to floating-point rounding. Here the
perturbation is applied per layer while that layer runs (its weights plus ε·z for that layer,
regenerated from the seed, then dropped): no copy of the parameters is made, at most one
layer's perturbation is alive, and the parameters are never written — they are restored
bit-exactly by construction.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jvp
from torch.utils.flop_counter import FlopCounterMode

from rematlab import zoo
from rematlab.exceptions import ConfigError
from rematlab.probes import LiveTensorTracker
from rematlab.steps import make_optimizer
from rematlab.strategies import apply as apply_strategy

LossFn = Callable[[nn.Module], torch.Tensor]


# --- estimators -----------------------------------------------------------------------------


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def direction(seed: int, index: int, like: torch.Tensor) -> torch.Tensor:
    """The seed trick: the same (seed, parameter index) always regenerates the same z."""
    gen = torch.Generator(device=like.device).manual_seed(seed * 1_000_003 + index)
    return torch.randn(like.shape, generator=gen, device=like.device, dtype=like.dtype)


@contextlib.contextmanager
def perturbed(model: nn.Module, seed: int, eps: float) -> Iterator[None]:
    """Run `model` as if every trainable parameter were θ + eps·z(seed); see module note."""
    index = {id(p): i for i, (_, p) in enumerate(_trainable(model))}
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


def zo_gradient(model: nn.Module, loss_fn: LossFn, k: int, eps: float, seed: int) -> torch.Tensor:
    """Two-point SPSA averaged over k directions into `.grad`; returns the unperturbed loss
    estimate (mean of the two evaluations)."""
    params = _trainable(model)
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


def fmad_gradient(model: nn.Module, loss_fn: LossFn, k: int, seed: int) -> torch.Tensor:
    """Forward gradient averaged over k directions into `.grad` (torch.func.jvp)."""
    params = _trainable(model)
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


def bp_gradient(model: nn.Module, loss_fn: LossFn) -> torch.Tensor:
    for _, p in _trainable(model):
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


def estimate(method: Method, model: nn.Module, loss_fn: LossFn, seed: int,
             eps: float = 1e-3) -> torch.Tensor:
    """Fill `.grad` of the trainable parameters with `method`'s estimate; return the loss."""
    if method.kind in ("bp", "bp+ckpt"):
        return bp_gradient(model, loss_fn)
    if method.kind == "fmad":
        return fmad_gradient(model, loss_fn, method.k, seed)
    return zo_gradient(model, loss_fn, method.k, eps, seed)


# --- tasks and models -----------------------------------------------------------------------


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
        return model, digits()
    raise ConfigError(f"unknown model {name!r} for the gradient comparison; use mlp3, mlp5, "
                      "mlp7, lenet5, synthetic-mlp5 or module:factory (64 inputs, 10 classes)")


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update B·A (B starts at zero)."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.a), self.b)


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


# --- training -------------------------------------------------------------------------------


@dataclass
class Run:
    """One training run: curves at evaluation points and per-step costs."""

    model: str
    method: str
    seed: int
    lr: float
    finetune: bool
    steps: list[int] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    flops: list[float] = field(default_factory=list)
    cosine: list[float] = field(default_factory=list)
    flops_per_step: float = 0.0
    peak_bytes: int = 0
    param_bytes: int = 0
    diverged: bool = False
    state: dict | None = field(default=None, repr=False)  # final weights, when asked for

    @property
    def final_accuracy(self) -> float:
        return self.accuracy[-1] if self.accuracy else 0.0

    def to_reach(self, target: float) -> dict[str, float | None]:
        for i, acc in enumerate(self.accuracy):
            if acc >= target:
                return {"steps": self.steps[i], "seconds": self.seconds[i],
                        "flops": self.flops[i]}
        return {"steps": None, "seconds": None, "flops": None}

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "state"}


def _accuracy(model: nn.Module, task: Task) -> float:
    with torch.no_grad():
        return float((model(task.x_test).argmax(1) == task.y_test).float().mean())


def _cosine(model: nn.Module, grads: list[torch.Tensor], loss_fn: LossFn) -> float:
    """Cosine similarity between the estimate in `.grad` and the true gradient."""
    params = [p for _, p in _trainable(model)]
    est = torch.cat([g.flatten() for g in grads])
    true = torch.autograd.grad(loss_fn(model), params)
    true = torch.cat([t.flatten() for t in true])
    return float(F.cosine_similarity(est, true, dim=0))


def _costs(method: Method, model: nn.Module, loss_fn: LossFn) -> tuple[float, int]:
    """FLOPs of one gradient estimate + optimizer step, and its peak live bytes."""
    counter = FlopCounterMode(display=False)
    with counter:
        estimate(method, model, loss_fn, seed=0)
    tracker = LiveTensorTracker()
    params = [p for p in model.parameters()]
    for p in params:
        p.grad = None
    tracker.track([*params, *model.buffers()])
    with tracker:
        estimate(method, model, loss_fn, seed=0)
    for p in params:
        p.grad = None
    return float(counter.get_total_flops()), tracker.peak


def train(model_name: str, method: str | Method, *, seed: int = 0, lr: float = 0.05,
          steps: int = 150, batch: int = 64, eval_every: int = 15, finetune: bool = False,
          eps: float = 1e-3, keep_weights: bool = False) -> Run:
    """Train one model with one gradient estimator; SGD with momentum 0.9 for every method."""
    m = Method.parse(method) if isinstance(method, str) else method
    torch.manual_seed(seed)
    net, task = build_model(model_name)
    if finetune:
        net = _pretrained(model_name, net, seed)
        net = for_finetuning(net, task.classes)
    model = apply_strategy(net, m.strategy) if m.kind == "bp+ckpt" else net
    params = [p for _, p in _trainable(model)]
    opt = make_optimizer("momentum", params, lr=lr)
    run = Run(model_name, str(m), seed, lr, finetune)
    gen = torch.Generator().manual_seed(seed)
    batch_x, batch_y = task.x_train[:batch], task.y_train[:batch]

    def loss_fn(mod: nn.Module) -> torch.Tensor:
        return F.cross_entropy(mod(batch_x), batch_y)

    run.flops_per_step, run.peak_bytes = _costs(m, model, loss_fn)
    run.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    elapsed, first_loss = 0.0, None
    for step in range(steps + 1):
        if step % eval_every == 0 or step == steps:
            run.steps.append(step)
            run.accuracy.append(_accuracy(model, task))
            run.seconds.append(elapsed)
            run.flops.append(step * run.flops_per_step)
        if step == steps:
            break
        idx = torch.randint(0, len(task.x_train), (batch,), generator=gen)
        batch_x, batch_y = task.x_train[idx], task.y_train[idx]
        t0 = time.perf_counter()
        loss = estimate(m, model, loss_fn, seed=seed * 100_003 + step * 131, eps=eps)
        elapsed += time.perf_counter() - t0
        if step % eval_every == 0:  # untimed: the estimate against the true gradient
            run.cosine.append(_cosine(model, [p.grad for p in params], loss_fn))
        t0 = time.perf_counter()
        opt.step()
        elapsed += time.perf_counter() - t0
        value = float(loss)
        first_loss = first_loss if first_loss is not None else value
        if not math.isfinite(value) or value > 10 * max(first_loss, 1.0):
            run.diverged = True
            break
    if keep_weights:
        run.state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return run


_PRETRAINED: dict[tuple[str, int], dict] = {}


def _pretrained(model_name: str, net: nn.Sequential, seed: int, steps: int = 200
                ) -> nn.Sequential:
    """The backbone for fine-tuning: trained by BP on digits 0-4 only (cached)."""
    key = (model_name, seed)
    if key not in _PRETRAINED:
        task = digits(image=model_name == "lenet5", classes=(0, 1, 2, 3, 4))
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            idx = torch.randint(0, len(task.x_train), (64,), generator=gen)
            opt.zero_grad()
            F.cross_entropy(net(task.x_train[idx]), task.y_train[idx]).backward()
            opt.step()
        _PRETRAINED[key] = copy.deepcopy(net.state_dict())
    net.load_state_dict(_PRETRAINED[key])
    return net


# --- the comparison -------------------------------------------------------------------------


@dataclass
class Comparison:
    runs: list[Run]
    best_lr: dict[str, float]
    table: list[dict]
    verdict: dict[str, dict]

    def to_dict(self) -> dict:
        return {"best_lr": self.best_lr, "table": self.table, "verdict": self.verdict,
                "runs": [r.to_dict() for r in self.runs]}


LRS = {"bp": [0.01, 0.05, 0.2], "fmad": [1e-4, 1e-3, 1e-2], "zo": [1e-4, 1e-3, 1e-2]}


def compare(models: list[str], budgets: list[int], seeds: int = 3, *, steps: int = 150,
            finetune: bool = False, strategy: str = "sqrt",
            progress: Callable[[str], None] | None = None) -> Comparison:
    """Every method on every model: learning rate chosen on seed 0 from the same grid for each
    method family, then `seeds` seeds at that rate."""
    for model in models:  # fail on a bad name before any training starts
        build_model(model)
    methods = [Method("bp"), Method("bp+ckpt", strategy=strategy)]
    methods += [Method("fmad", k=k) for k in budgets] + [Method("zo", k=k) for k in budgets]
    runs: list[Run] = []
    best_lr: dict[str, float] = {}
    for model in models:
        for m in methods:
            family = "bp" if m.kind.startswith("bp") else m.kind
            trials = []
            for lr in LRS[family]:
                if progress:
                    progress(f"{model} {m} lr={lr} (learning-rate search)")
                trials.append(train(model, m, seed=0, lr=lr, steps=steps, finetune=finetune))
            best = max(trials, key=lambda r: (not r.diverged, r.final_accuracy))
            best_lr[f"{model}/{m}"] = best.lr
            runs.append(best)
            for seed in range(1, seeds):
                if progress:
                    progress(f"{model} {m} seed {seed}")
                runs.append(train(model, m, seed=seed, lr=best.lr, steps=steps,
                                  finetune=finetune))
    table = summarize(runs)
    return Comparison(runs, best_lr, table, verdict(table))


def summarize(runs: list[Run]) -> list[dict]:
    """Mean over seeds per (model, method), with time/FLOPs/steps to 90% of BP's accuracy."""
    rows = []
    by_model: dict[str, list[Run]] = {}
    for r in runs:
        by_model.setdefault(r.model, []).append(r)
    for model, group in by_model.items():
        bp = [r.final_accuracy for r in group if r.method == "bp"]
        target = 0.9 * float(np.mean(bp)) if bp else 0.0
        methods = sorted({r.method for r in group}, key=_method_order)
        for method in methods:
            rs = [r for r in group if r.method == method]
            reach = [r.to_reach(target) for r in rs]
            reached = [x for x in reach if x["steps"] is not None]
            rows.append({
                "model": model, "method": method, "seeds": len(rs), "lr": rs[0].lr,
                "final_accuracy": float(np.mean([r.final_accuracy for r in rs])),
                "accuracy_std": float(np.std([r.final_accuracy for r in rs])),
                "target_accuracy": target,
                "reached": f"{len(reached)}/{len(rs)}",
                "steps_to_target": _mean([x["steps"] for x in reached], len(rs)),
                "seconds_to_target": _mean([x["seconds"] for x in reached], len(rs)),
                "flops_to_target": _mean([x["flops"] for x in reached], len(rs)),
                "flops_per_step": float(np.mean([r.flops_per_step for r in rs])),
                "seconds_total": float(np.mean([r.seconds[-1] for r in rs])),
                "peak_bytes": int(np.median([r.peak_bytes for r in rs])),
                "param_bytes": int(rs[0].param_bytes),
                "non_param_bytes": int(np.median([r.peak_bytes - r.param_bytes for r in rs])),
                "cosine_to_true_grad": float(np.mean([np.mean(r.cosine) for r in rs
                                                      if r.cosine] or [math.nan])),
                "diverged": sum(r.diverged for r in rs),
            })
    return rows


def _method_order(name: str) -> tuple:
    kind, _, arg = name.partition(":")
    order = {"bp": 0, "bp+ckpt": 1, "fmad": 2, "zo": 3}
    return order.get(kind, 9), int(arg) if arg.isdigit() else 0


def _mean(values: list, n: int) -> float | None:
    """Mean over the seeds that reached the target, when at least half of them did;
    else None (not reached). `reached` in the table says how many did."""
    return float(np.mean(values)) if values and 2 * len(values) >= n else None


def verdict(table: list[dict]) -> dict[str, dict]:
    """BP+checkpointing versus the best FmAD and the best ZO (by final accuracy), per model,
    stated as the paper's figures: accuracy gain, convergence speed-up, computation ratio,
    plus memory."""
    out: dict[str, dict] = {}
    for model in sorted({r["model"] for r in table}):
        rows = [r for r in table if r["model"] == model]
        ck = next((r for r in rows if r["method"].startswith("bp+ckpt")), None)
        if ck is None:
            continue
        out[model] = {}
        for family in ("fmad", "zo"):
            rivals = [r for r in rows if r["method"].startswith(family)]
            if not rivals:
                continue
            best = max(rivals, key=lambda r: r["final_accuracy"])
            entry = {"rival": best["method"],
                     "accuracy_gain": ck["final_accuracy"] / max(best["final_accuracy"], 1e-9)
                     - 1.0,
                     "accuracy_points": ck["final_accuracy"] - best["final_accuracy"],
                     "memory_ratio": ck["non_param_bytes"] / max(best["non_param_bytes"], 1)}
            if ck["seconds_to_target"] and best["seconds_to_target"]:
                entry["faster_convergence"] = 1.0 - ck["seconds_to_target"] / best[
                    "seconds_to_target"]
                entry["fewer_computations"] = best["flops_to_target"] / ck["flops_to_target"]
            else:
                entry["faster_convergence"] = None if not ck["seconds_to_target"] else math.inf
                entry["fewer_computations"] = None if not ck["flops_to_target"] else math.inf
            entry["statement"] = _statement(entry)
            out[model][family] = entry
    return out


def _statement(e: dict) -> str:
    parts = [f"BP+checkpointing reaches {e['accuracy_gain']:+.1%} accuracy versus {e['rival']}"]
    fc = e["faster_convergence"]
    if fc is None:
        parts.append("neither reaches the target accuracy" if e["fewer_computations"] is None
                     else "BP+checkpointing does not reach the target")
    elif math.isinf(fc):
        parts.append(f"{e['rival']} never reaches the target accuracy (90% of BP's)")
    else:
        parts.append(f"converges {fc:.1%} faster in time")
        parts.append(f"uses {e['fewer_computations']:.1f}x fewer FLOPs to the target")
    parts.append(f"with {e['memory_ratio']:.2f}x its non-parameter peak memory")
    return ", ".join(parts)
