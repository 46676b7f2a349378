"""Backprop with checkpointing versus forward-mode AD and zeroth-order training: every
method trained (`rematlab.gradients.training`) at its best learning rate over seeds, then
summarised with intervals and compared with the paper's claims.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from rematlab.core.checks import bounded
from rematlab.core.spread import bootstrap
from rematlab.gradients import peft
from rematlab.gradients.estimators import Method
from rematlab.gradients.tasks import build_model
from rematlab.gradients.training import Run, Training, train, training_of
from rematlab.remat.strategies import parse


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


def compare(models: list[str], budgets: list[int], seeds: int = 3, *,
            how: Training | None = None, strategy: str = "sqrt",
            progress: Callable[[str], None] | None = None, **keywords: object) -> Comparison:
    """Every method on every model. The learning rate of BP, FmAD:K and ZO:K is chosen on
    seed 0 from the same grid per family, then seeds 1.. run at that rate; BP with
    checkpointing computes BP's gradients, so it runs at BP's rate. `how` (or its fields as
    keywords: `steps`, `batch`, `eval_every`, `finetune`) says how each run trains; by
    default it is evaluated a hundred times.

    For `bert-topics` (the paper's regime, `rematlab.gradients.peft`) BP+checkpointing runs twice:
    transformers' layer checkpointing (`bp+ckpt:layers`, the paper's baseline) and
    `bp+ckpt:matched`, rematlab's plan for a budget equal to the measured step peak of the
    best ZO run (the paper's "comparable memory", exact). Other models use `strategy`."""
    how = training_of(how, keywords, Training(eval_every=0))  # 0 or None: every 1 % of it
    how = replace(how, eval_every=how.eval_every or max(1, how.steps // 100))
    bounded("seeds", seeds, MAX_SEEDS)
    bounded("steps", how.steps, MAX_STEPS)
    bounded("batch", how.batch, MAX_STEPS)
    for k in budgets:
        bounded("directions per step (budgets)", k, MAX_DIRECTIONS)
    strat = parse(strategy)
    for model in models:  # fail on a bad name, a model that misfits, or a plan made for
        if model != peft.MODEL:  # another model, before any training
            net, _ = build_model(model)
            if strat.kind == "plan":
                strat.build(len(net))
    runner = _Runner(how, seeds, progress)
    runs: list[Run] = []
    for model in models:
        regime = model == peft.MODEL
        grid = PEFT_LRS if regime else LRS
        runs += runner.method(model, Method("bp"), grid["bp"])
        runs += runner.method(model, Method("bp+ckpt", strategy="layers" if regime
                                            else strategy), None)
        rivals: list[Run] = []
        for kind in ("fmad", "zo"):
            for k in budgets:
                rivals += runner.method(model, Method(kind, k=k), grid[kind])
        runs += rivals
        if regime:
            runs += runner.matched(model, rivals)
    table = summarize(runs)
    return Comparison(runs, runner.best_lr, table, verdict(table, runs), runner.budgets)


class _Runner:
    """Runs each method's seeds, keeping each family's chosen learning rate and, in the
    paper's regime, the budget BP+checkpointing was matched to."""

    def __init__(self, how: Training, seeds: int, progress: Callable[[str], None] | None
                 ) -> None:
        self.how, self.seeds, self.progress = how, seeds, progress
        self.best_lr: dict[str, float] = {}
        self.budgets: dict[str, dict] = {}

    def _say(self, text: str) -> None:
        if self.progress:
            self.progress(text)

    def method(self, model: str, m: Method, lrs: list[float] | None,
               matched: peft.Matched | None = None) -> list[Run]:
        """`m`'s runs: the learning rate searched on seed 0 over `lrs` (None: BP's), then
        the other seeds at it."""
        def run(seed: int, lr: float) -> Run:
            return train(model, m, replace(self.how, seed=seed, lr=lr), matched=matched,
                         progress=self.progress)

        first = None
        if lrs is None:  # BP's rate
            lr = self.best_lr[f"{model}/bp"]
        else:
            trials = []
            for lr in lrs:
                self._say(f"{model} {m} lr={lr} (learning-rate search)")
                trials.append(run(0, lr))
            first = max(trials, key=lambda r: (not r.diverged, r.final_accuracy))
            lr = first.lr
        self.best_lr[f"{model}/{m}"] = lr
        done = [] if first is None else [first]
        for seed in range(0 if first is None else 1, self.seeds):
            self._say(f"{model} {m} seed {seed}")
            done.append(run(seed, lr))
        return done

    def matched(self, model: str, rivals: list[Run]) -> list[Run]:
        """`bp+ckpt:matched`: rematlab's plan for the measured step peak of the best ZO run
        on seed 0, over as many micro-batches as it needs."""
        zo = [r for r in rivals if r.method.startswith("zo") and r.seed == 0]
        best = max(zo, key=lambda r: (not r.diverged, r.final_accuracy))
        net, task = peft.finetune_model(0, self.progress)
        batch = self.how.batch
        fit = peft.matched(net, task.x_train[:batch], task.y_train[:batch], best.peak_bytes)
        self.budgets[model] = {"matches": best.method, "budget": best.peak_bytes,
                               "plan": fit.plan.describe(), "micro_batches": fit.accumulate,
                               "plan_measured_peak": fit.plan.measured_peak}
        self._say(f"{model}: matched memory {best.peak_bytes} bytes ({best.method}): plan "
                  f"{fit.plan.describe()} over {fit.accumulate} micro-batches")
        return self.method(model, Method("bp+ckpt", strategy="matched"), None, fit)


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


def _bootstrap(a: list[float], b: list[float], statistic: Callable[[float, float], float]
               ) -> tuple[float, float] | None:
    """95 % percentile bootstrap of `statistic(mean(a), mean(b))`, seeds resampled within
    each method; None with fewer than two runs on either side or no spread to resample."""
    if len(a) < 2 or len(b) < 2 or (len(set(a)) == 1 and len(set(b)) == 1):
        return None
    return bootstrap((a, b), lambda x, y: statistic(float(np.mean(x)), float(np.mean(y))))


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
