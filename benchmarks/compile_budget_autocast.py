"""torch.compile's own activation budget against rematlab's plans, under bf16 autocast on this
CPU (issue 50, item 3: the peer that recomputes inside the compiled graph).

    .venv/bin/python benchmarks/compile_budget_autocast.py [--rounds 5]
        [--out docs/benchmarks/compile-budget-autocast.md]

GPT-2, a Llama-style decoder and BERT (4 layers, width 256, 8 x 256 tokens), AdamW in bf16
autocast (`Step(precision="bf16")`). For each `activation_memory_budget` fraction, the plain
model compiled (`torch.compile(model)`, dynamo reset between fractions, since a fraction is
read when a graph is compiled): its measured step peak (the planner's measurement, whose
allocator trace sees inside compiled code) and its step time. Beside it, rematlab's choices
at that peak as the budget: the compiled one (`prepare(..., compile=True)`, whose candidates
include torch.compile's own fractions; run as `torch.compile(apply(model, plan))`), and the
eager op-level (`prepare(..., ops=True)`) and per-layer plans. All times are medians of
interleaved rounds of one side-by-side run per fraction (the compiled candidates and the
eager ones, by the one timer under the interference guard), as ratios to the eager plain
step measured in the same rounds. A candidate whose measured peak is above the compiled
one is marked: the comparison is at an equal or lower peak. The compiled plain step runs
under its fraction (dynamo guards on the setting); rematlab's compiled plan scopes its own.
The
models' key/value cache is off (`use_cache=False`, as training loops and transformers' own
checkpointing set it), else dynamo recompiles the cache update per layer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from op_level_autocast import TRANSFORMERS, bf16_main
from real_models import _side_by_side

from rematlab.core.recipe import Step
from rematlab.core.units import format_bytes
from rematlab.exceptions import InfeasibleBudgetError
from rematlab.planning.planner import prepare
from rematlab.plans.plan import Plan
from rematlab.remat.strategies import apply

FRACTIONS = (0.0, 0.5, 1.0)


def _choice(planning, budget: int) -> Plan | None:
    try:
        return planning.choose(budget)
    except InfeasibleBudgetError:
        return None


def _at_fraction(fn, fraction: float):
    """`fn` called with torch's `activation_memory_budget` at `fraction`, the setting it was
    compiled under: dynamo guards on it, and would compile it again at the default."""
    def run(*args, **kwargs):
        with torch._functorch.config.patch(activation_memory_budget=fraction):
            return fn(*args, **kwargs)
    return run


def _ready(model, plan: Plan):
    """The candidate of a plan: eager, or (a compiled plan) `torch.compile(apply(model,
    plan))` compiled once here, outside any patched fraction (its own, if it has one, is
    scoped to it by `apply`)."""
    planned = apply(model, plan)
    if not plan.compiled:
        return lambda: planned
    fn = torch.compile(planned, dynamic=False)
    return lambda: fn


def bench(name: str, make, step: Step, rounds: int) -> list[str]:
    torch.manual_seed(0)
    model, batch = make()
    model.train()
    model.config.use_cache = False  # as training loops set it: no key/value cache to compile
    ops = prepare(model, batch, step=step, ops=True)
    layers = prepare(model, batch, step=step)
    compiled_choice = prepare(model, batch, step=step, compile=True, fractions=FRACTIONS)
    n = ops.costs.n
    lines = [f"### {name}", "", "| fraction | candidate | plan | measured peak | "
             "time / eager plain (± IQR) |", "|---|---|---|---|---|"]
    for fraction in FRACTIONS:
        torch._dynamo.reset()
        with torch._functorch.config.patch(activation_memory_budget=fraction):
            peak = ops.measure(Plan(n, tuple(range(n)), compiled=True))
            compiled = torch.compile(model, dynamic=False)
            step.train_step(model, batch, run=compiled)  # compiled here, at this fraction
        plans = {"compiled": _choice(compiled_choice, peak), "op-level": _choice(ops, peak),
                 "per-layer": _choice(layers, peak)}
        runs = {"torch.compile": lambda fn=compiled, f=fraction: _at_fraction(fn, f),
                **{k: _ready(model, p) for k, p in plans.items() if p}}
        got, evidence = _side_by_side(runs, batch, model, rounds, step)
        base = got["none"][0]
        trust = "" if evidence.trusted else " (busy machine)"
        lines.append(f"| {fraction:g} | torch.compile{trust} | `activation_memory_budget="
                     f"{fraction:g}` | {format_bytes(peak)} | "
                     f"{got['torch.compile'][0] / base:.3f}x ±{got['torch.compile'][1]:.0%} |")
        for label, plan in plans.items():
            if plan is None:
                lines.append(f"| {fraction:g} | rematlab {label} | none fits | — | — |")
                continue
            mine = plan.measured_peak or 0
            mark = "" if mine <= peak else " (above)"
            lines.append(f"| {fraction:g} | rematlab {label} | `{plan.describe()}` | "
                         f"{format_bytes(mine)}{mark} | {got[label][0] / base:.3f}x "
                         f"±{got[label][1]:.0%} |")
    torch._dynamo.reset()
    return [*lines, ""]


def main() -> None:
    bf16_main(__doc__, "torch.compile's activation budget against rematlab's plans (bf16 "
              "autocast)", "compile_budget_autocast.py", bench, models=TRANSFORMERS)


if __name__ == "__main__":
    main()
