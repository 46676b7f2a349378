"""Backprop with checkpointing versus forward-mode AD and zeroth-order training.

One training loop, interchangeable gradient estimators (`estimators`), all feeding the
same optimizer, on the tasks of `rematlab.gradients.tasks`:

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

from rematlab.core.probes import StepMemory
from rematlab.core.steps import bounded, make_optimizer
from rematlab.exceptions import ConfigError
from rematlab.gradients import peft
from rematlab.gradients.estimators import LossFn, Method, estimate, trainable
from rematlab.gradients.tasks import Task, build_model, digits, for_finetuning
from rematlab.remat.strategies import apply as apply_strategy


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


def _logits(out: object) -> torch.Tensor:
    """A classifier's logits: the output itself, or a transformers output's `.logits`."""
    return out.logits if hasattr(out, "logits") else out


def _accuracy(model: nn.Module, task: Task) -> float:
    with torch.no_grad():
        return float((_logits(model(task.x_test)).argmax(1) == task.y_test).float().mean())


def _cosine(model: nn.Module, grads: list[torch.Tensor], loss_fn: LossFn) -> float:
    """Cosine similarity between the estimate in `.grad` and the true gradient."""
    params = [p for _, p in trainable(model)]
    est = torch.cat([g.flatten() for g in grads])
    true = torch.autograd.grad(loss_fn(model), params)
    true = torch.cat([t.flatten() for t in true])
    return float(F.cosine_similarity(est, true, dim=0))


Step = Callable[..., torch.Tensor]  # (model, optimizer, index) -> loss


def _costs(method: Method, model: nn.Module, loss_fn: LossFn, step: Step, lr: float,
           batch: list[torch.Tensor]) -> tuple[float, int]:
    """FLOPs of one gradient estimate, and the measured peak of one whole training step
    (estimate and optimizer step, with the optimizer's state, parameters, buffers and the
    batch alive), by `probes.StepMemory` as rematlab measures every step — on a copy, after
    a warm-up step that creates the optimizer's state, so training is untouched."""
    counter = FlopCounterMode(display=False)
    probe = copy.deepcopy(model)
    with counter:
        estimate(method, probe, loss_fn, seed=0)
    opt = make_optimizer("momentum", [p for _, p in trainable(probe)], lr=lr)
    step(probe, opt, 0)
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    memory = StepMemory(torch.device("cpu"))
    memory.track([*probe.parameters(), *probe.buffers(), *state, *batch])
    with memory, memory.phase("step"):
        step(probe, opt, 1)
    return float(counter.get_total_flops()), memory.peak


def _setup(model_name: str, seed: int, finetune: bool,
           progress: Callable[[str], None] | None) -> tuple[nn.Module, Task]:
    """The network to train and its task: a pretrained transformer with LoRA adapters
    (`rematlab.gradients.peft`), or a zoo model on digits, optionally pretrained and adapted."""
    if model_name == peft.MODEL:
        return peft.finetune_model(seed, progress)
    net, task = build_model(model_name)
    if finetune:
        net = _pretrained(model_name, net, seed)
        net = for_finetuning(net, task.classes)
    return net, task


def _prepared(m: Method, net: nn.Module, model_name: str, matched: peft.Matched | None,
              example: torch.Tensor) -> nn.Module:
    """`net` as `m` trains it: plain, under a rematlab strategy, under transformers' layer
    checkpointing (`bp+ckpt:layers`), or under the matched-memory plan."""
    if m.kind != "bp+ckpt":
        return net
    blocks = peft.BLOCKS if model_name == peft.MODEL else None
    if m.strategy == "layers":
        if not hasattr(net, "activation_checkpointing_enable"):
            raise ConfigError("bp+ckpt:layers is transformers' layer checkpointing; "
                              f"{model_name} is not a transformers model")
        return peft.layer_checkpointing(net)
    if m.strategy == "matched":
        if matched is None:
            raise ConfigError("bp+ckpt:matched needs the budget of the method it matches")
        return apply_strategy(net, matched.plan, blocks=blocks,
                              example_input=example[: len(example) // matched.accumulate])
    return apply_strategy(net, m.strategy, blocks=blocks, example_input=example)


def train(model_name: str, method: str | Method, *, seed: int = 0, lr: float = 0.05,
          steps: int = 150, batch: int = 64, eval_every: int = 15, finetune: bool = False,
          eps: float = 1e-3, keep_weights: bool = False, matched: peft.Matched | None = None,
          progress: Callable[[str], None] | None = None) -> Run:
    """Train one model with one gradient estimator; SGD with momentum 0.9 for every method.
    `matched` (for `bp+ckpt:matched`): rematlab's plan and micro-batch count for a budget."""
    m = Method.parse(method) if isinstance(method, str) else method
    torch.manual_seed(seed)
    net, task = _setup(model_name, seed, finetune, progress)
    batch_x, batch_y = task.x_train[:batch], task.y_train[:batch]
    model = _prepared(m, net, model_name, matched, batch_x)
    parts = matched.accumulate if matched is not None and m.strategy == "matched" else 1
    params = [p for _, p in trainable(model)]
    opt = make_optimizer("momentum", params, lr=lr)
    run = Run(model_name, str(m), seed, lr, finetune or model_name == peft.MODEL)
    gen = torch.Generator().manual_seed(seed)

    def loss_on(mod: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(_logits(mod(x)), y)

    def loss_fn(mod: nn.Module) -> torch.Tensor:
        return loss_on(mod, batch_x, batch_y)

    def step(mod: nn.Module, optimizer: torch.optim.Optimizer, index: int,
             observe: Callable[[], None] | None = None) -> torch.Tensor:
        """One gradient estimate (accumulated over `parts` micro-batches), `observe`d
        before the update, and the update."""
        if parts == 1:
            loss = estimate(m, mod, loss_fn, seed=seed * 100_003 + index * 131, eps=eps)
        else:
            for p in optimizer.param_groups[0]["params"]:
                p.grad = None
            total = torch.zeros(())
            for xs, ys in zip(batch_x.chunk(parts), batch_y.chunk(parts), strict=True):
                part = loss_on(mod, xs, ys) / parts
                part.backward()
                total += part.detach()
            loss = total
        if observe is not None:
            observe()
        optimizer.step()
        return loss

    run.flops_per_step, run.peak_bytes = _costs(m, model, loss_fn, step, lr,
                                                [batch_x, batch_y])
    run.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    elapsed, first_loss = 0.0, None
    for index in range(steps + 1):
        if index % eval_every == 0 or index == steps:
            run.steps.append(index)
            run.accuracy.append(_accuracy(model, task))
            run.seconds.append(elapsed)
            run.flops.append(index * run.flops_per_step)
        if index == steps:
            break
        idx = torch.randint(0, len(task.x_train), (batch,), generator=gen)
        batch_x, batch_y = task.x_train[idx], task.y_train[idx]
        untimed = 0.0

        def observe() -> None:  # the estimate against the true gradient, untimed
            nonlocal untimed
            t = time.perf_counter()
            run.cosine.append(_cosine(model, [p.grad for p in params], loss_fn))
            untimed += time.perf_counter() - t

        t0 = time.perf_counter()
        loss = step(model, opt, index, observe if index % eval_every == 0 else None)
        elapsed += time.perf_counter() - t0 - untimed
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
    matched: dict[str, dict] = field(default_factory=dict)  # model -> the matched budget

    def to_dict(self) -> dict:
        return {"best_lr": self.best_lr, "table": self.table, "verdict": self.verdict,
                "matched": self.matched, "paper": PAPER,
                "runs": [r.to_dict() for r in self.runs]}


LRS = {"bp": [0.01, 0.05, 0.2], "fmad": [1e-4, 1e-3, 1e-2], "zo": [1e-4, 1e-3, 1e-2]}
PEFT_LRS = {"bp": [0.03, 0.1, 0.3], "fmad": [3e-4, 1e-3, 3e-3], "zo": [3e-4, 1e-3, 3e-3]}
TARGET = 0.9  # of BP's mean final accuracy: the accuracy every convergence figure aims at


MAX_SEEDS = 1000
MAX_STEPS = 1_000_000  # training steps per run (and samples per step)
MAX_DIRECTIONS = 4096  # random directions per step for FmAD:K and ZO:K


def compare(models: list[str], budgets: list[int], seeds: int = 3, *, steps: int = 150,
            batch: int = 64, eval_every: int | None = None, finetune: bool = False,
            strategy: str = "sqrt", progress: Callable[[str], None] | None = None
            ) -> Comparison:
    """Every method on every model. The learning rate of BP, FmAD:K and ZO:K is chosen on
    seed 0 from the same grid per family, then seeds 1.. run at that rate; BP with
    checkpointing computes BP's gradients, so it runs at BP's rate.

    For `bert-topics` (the paper's regime, `rematlab.gradients.peft`) BP+checkpointing runs twice:
    transformers' layer checkpointing (`bp+ckpt:layers`, the paper's baseline) and
    `bp+ckpt:matched`, rematlab's plan for a budget equal to the measured step peak of the
    best ZO run (the paper's "comparable memory", exact). Other models use `strategy`."""
    bounded("seeds", seeds, MAX_SEEDS)
    bounded("steps", steps, MAX_STEPS)
    bounded("batch", batch, MAX_STEPS)
    for k in budgets:
        bounded("directions per step (budgets)", k, MAX_DIRECTIONS)
    for model in models:  # fail on a bad name, or a model that misfits, before any training
        if model != peft.MODEL:
            build_model(model)
    eval_every = eval_every or max(1, steps // 100)
    runs: list[Run] = []
    best_lr: dict[str, float] = {}
    matched_budget: dict[str, dict] = {}

    def run_method(model: str, m: Method, lrs: list[float] | None,
                   matched: peft.Matched | None = None) -> list[Run]:
        kw = {"steps": steps, "batch": batch, "eval_every": eval_every,
              "finetune": finetune, "matched": matched, "progress": progress}
        if lrs is None:  # BP's rate
            lr = best_lr[f"{model}/bp"]
            first = None
        else:
            trials = []
            for lr in lrs:
                if progress:
                    progress(f"{model} {m} lr={lr} (learning-rate search)")
                trials.append(train(model, m, seed=0, lr=lr, **kw))
            first = max(trials, key=lambda r: (not r.diverged, r.final_accuracy))
            lr = first.lr
        best_lr[f"{model}/{m}"] = lr
        done = [] if first is None else [first]
        for seed in range(0 if first is None else 1, seeds):
            if progress:
                progress(f"{model} {m} seed {seed}")
            done.append(train(model, m, seed=seed, lr=lr, **kw))
        return done

    for model in models:
        regime = model == peft.MODEL
        grid = PEFT_LRS if regime else LRS
        runs += run_method(model, Method("bp"), grid["bp"])
        runs += run_method(model, Method("bp+ckpt", strategy="layers" if regime else strategy),
                           None)
        rivals: list[Run] = []
        for kind in ("fmad", "zo"):
            for k in budgets:
                got = run_method(model, Method(kind, k=k), grid[kind])
                rivals += got
        runs += rivals
        if regime:
            zo = [r for r in rivals if r.method.startswith("zo") and r.seed == 0]
            best = max(zo, key=lambda r: (not r.diverged, r.final_accuracy))
            net, task = peft.finetune_model(0, progress)
            fit = peft.matched(net, task.x_train[:batch], task.y_train[:batch],
                               best.peak_bytes)
            matched_budget[model] = {"matches": best.method, "budget": best.peak_bytes,
                                     "plan": fit.plan.describe(),
                                     "micro_batches": fit.accumulate,
                                     "plan_measured_peak": fit.plan.measured_peak}
            if progress:
                progress(f"{model}: matched memory {best.peak_bytes} bytes ({best.method}): "
                         f"plan {fit.plan.describe()} over {fit.accumulate} micro-batches")
            runs += run_method(model, Method("bp+ckpt", strategy="matched"), None, fit)
    table = summarize(runs)
    return Comparison(runs, best_lr, table, verdict(table, runs), matched_budget)


def _interval(values: list[float], bounds: tuple[float, float] = (-1.0, 1.0)
              ) -> tuple[float, float] | None:
    """95 % t-interval of the mean over seeds, within `bounds` (accuracies and their gaps
    cannot leave [-1, 1]); None with fewer than two values."""
    from scipy import stats

    clean = [v for v in values if v is not None and math.isfinite(v)]
    if len(clean) < 2:
        return None
    mean, sem = float(np.mean(clean)), float(stats.sem(clean))
    if sem == 0:
        return mean, mean
    lo, hi = stats.t.interval(0.95, len(clean) - 1, loc=mean, scale=sem)
    return max(bounds[0], float(lo)), min(bounds[1], float(hi))


def _bootstrap(a: list[float], b: list[float], statistic: Callable[[float, float], float],
               draws: int = 2000) -> tuple[float, float] | None:
    """95 % percentile bootstrap of `statistic(mean(a), mean(b))`, seeds resampled within
    each method."""
    if len(a) < 2 or len(b) < 2:
        return None
    rng = np.random.default_rng(0)
    xa, xb = np.asarray(a, float), np.asarray(b, float)
    values = [statistic(float(rng.choice(xa, len(xa)).mean()),
                        float(rng.choice(xb, len(xb)).mean())) for _ in range(draws)]
    lo, hi = np.percentile(values, [2.5, 97.5])
    return float(lo), float(hi)


def summarize(runs: list[Run]) -> list[dict]:
    """Mean over seeds per (model, method), with a 95 % interval on the final accuracy, and
    steps/time/FLOPs to `TARGET` of BP's mean final accuracy."""
    rows = []
    by_model: dict[str, list[Run]] = {}
    for r in runs:
        by_model.setdefault(r.model, []).append(r)
    for model, group in by_model.items():
        bp = [r.final_accuracy for r in group if r.method == "bp"]
        target = TARGET * float(np.mean(bp)) if bp else 0.0
        methods = sorted({r.method for r in group}, key=_method_order)
        for method in methods:
            rs = [r for r in group if r.method == method]
            reach = [r.to_reach(target) for r in rs]
            reached = [x for x in reach if x["steps"] is not None]
            accuracy = [r.final_accuracy for r in rs]
            rows.append({
                "model": model, "method": method, "seeds": len(rs), "lr": rs[0].lr,
                "final_accuracy": float(np.mean(accuracy)),
                "accuracy_std": float(np.std(accuracy)),
                "accuracy_ci": _interval(accuracy, (0.0, 1.0)),
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
    return order.get(kind, 9), int(arg) if arg.isdigit() else 0, arg  # arg: a total order


def _mean(values: list, n: int) -> float | None:
    """Mean over the seeds that reached the target, when at least half of them did;
    else None (not reached). `reached` in the table says how many did."""
    return float(np.mean(values)) if values and 2 * len(values) >= n else None


PAPER = {"accuracy_gain": 0.311, "faster_convergence": 0.348, "fewer_computations": 3.8}


def verdict(table: list[dict], runs: list[Run] | None = None) -> dict[str, dict]:
    """Each BP+checkpointing variant versus the best FmAD and the best ZO (by final
    accuracy), per model, in the paper's three figures — accuracy gain (relative, and in
    points), convergence speed-up in time and steps, computation ratio to the target — plus
    memory; with 95 % intervals over seeds when `runs` are given (the accuracy gap paired by
    seed, the ratios by bootstrap)."""
    out: dict[str, dict] = {}
    by = {}
    for r in runs or []:
        by.setdefault((r.model, r.method), []).append(r)
    for model in sorted({r["model"] for r in table}):
        rows = [r for r in table if r["model"] == model]
        out[model] = {}
        for ck in [r for r in rows if r["method"].startswith("bp+ckpt")]:
            for family in ("fmad", "zo"):
                rivals = [r for r in rows if r["method"].startswith(family)]
                if not rivals:
                    continue
                best = max(rivals, key=lambda r: r["final_accuracy"])
                entry = _versus(ck, best, by.get((model, ck["method"]), []),
                                by.get((model, best["method"]), []))
                key = family if len([r for r in rows if r["method"].startswith("bp+ckpt")]) \
                    == 1 else f"{family}, {ck['method']}"
                out[model][key] = entry
    return out


def _versus(ck: dict, best: dict, ck_runs: list[Run], rival_runs: list[Run]) -> dict:
    target = ck["target_accuracy"]
    entry: dict = {
        "method": ck["method"], "rival": best["method"],
        "accuracy_gain": ck["final_accuracy"] / max(best["final_accuracy"], 1e-9) - 1.0,
        "accuracy_points": ck["final_accuracy"] - best["final_accuracy"],
        "memory_ratio": ck["peak_bytes"] / max(best["peak_bytes"], 1),
        "non_param_memory_ratio": ck["non_param_bytes"] / max(best["non_param_bytes"], 1)}
    paired = {r.seed: r.final_accuracy for r in rival_runs}
    entry["accuracy_points_ci"] = _interval([r.final_accuracy - paired[r.seed]
                                             for r in ck_runs if r.seed in paired])
    if ck["seconds_to_target"] and best["seconds_to_target"]:
        entry["faster_convergence"] = 1.0 - ck["seconds_to_target"] / best["seconds_to_target"]
        entry["fewer_steps"] = 1.0 - ck["steps_to_target"] / best["steps_to_target"]
        entry["fewer_computations"] = best["flops_to_target"] / ck["flops_to_target"]

        def reach(rs: list[Run], key: str) -> list[float]:
            return [v for v in (r.to_reach(target)[key] for r in rs) if v is not None]

        entry["faster_convergence_ci"] = _bootstrap(
            reach(ck_runs, "seconds"), reach(rival_runs, "seconds"), lambda a, b: 1 - a / b)
        entry["fewer_computations_ci"] = _bootstrap(
            reach(ck_runs, "flops"), reach(rival_runs, "flops"), lambda a, b: b / a)
    else:
        entry["faster_convergence"] = None if not ck["seconds_to_target"] else math.inf
        entry["fewer_computations"] = None if not ck["flops_to_target"] else math.inf
    entry["statement"] = _statement(entry)
    return entry


def _span(ci: tuple[float, float] | None, fmt: str) -> str:
    return f" [{fmt.format(ci[0])}, {fmt.format(ci[1])}]" if ci else ""


def _statement(e: dict) -> str:
    ci = e.get("accuracy_points_ci")
    points = _span((100 * ci[0], 100 * ci[1]) if ci else None, "{:+.1f}")
    parts = [f"{e['method']} reaches {e['accuracy_points'] * 100:+.1f}{points} accuracy "
             f"points ({e['accuracy_gain']:+.1%}) versus {e['rival']}"]
    fc = e["faster_convergence"]
    if fc is None:
        parts.append("neither reaches the target accuracy" if e["fewer_computations"] is None
                     else f"{e['method']} does not reach the target")
    elif math.isinf(fc):
        parts.append(f"{e['rival']} never reaches the target accuracy "
                     f"({TARGET:.0%} of BP's)")
    else:
        parts.append(f"converges {fc:.1%}{_span(e.get('faster_convergence_ci'), '{:.1%}')} "
                     f"faster in time")
        parts.append(f"uses {e['fewer_computations']:.1f}x"
                     f"{_span(e.get('fewer_computations_ci'), '{:.1f}x')} fewer FLOPs to the "
                     f"target")
    parts.append(f"with {e['memory_ratio']:.2f}x its step's peak memory")
    return ", ".join(parts)
