"""Backprop with checkpointing versus forward-mode AD and zeroth-order training.

One training loop, interchangeable gradient estimators (`rematlab.estimators`), all feeding the
same optimizer, on the tasks of `rematlab.tasks`:

- `bp`: backpropagation;
- `bp+ckpt[:STRATEGY]`: backpropagation through `rematlab.apply(model, STRATEGY)` (sqrt);
- `fmad:K`: forward gradient, g = mean over K random directions v of (grad f . v) v, computed
  with `torch.func.jvp` — no activations are stored;
- `zo:K`: two-point SPSA, g = mean over K directions z of (f(θ+εz) - f(θ-εz)) / 2ε · z, with
  MeZO's seed trick: z is never stored, it is regenerated from a per-direction seed when needed.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from rematlab.estimators import LossFn, Method, estimate, trainable
from rematlab.probes import LiveTensorTracker
from rematlab.steps import make_optimizer
from rematlab.strategies import apply as apply_strategy
from rematlab.tasks import Task, build_model, digits, for_finetuning


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
    params = [p for _, p in trainable(model)]
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
    params = [p for _, p in trainable(model)]
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
