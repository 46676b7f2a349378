"""Op-level plans under bf16 autocast (issue 50), on this CPU: which options pay, measured.

    .venv/bin/python benchmarks/op_level_autocast.py [--rounds 5]
        [--out docs/benchmarks/op-level-autocast.md]

GPT-2 (4 layers, width 256, 8 x 256 tokens) trained in bf16 autocast with AdamW. For three
budgets between the floor and keeping everything: the plan with op-level options
(`prepare(..., ops=True)`) and the per-layer plan (`ops=False`), with every layer under each
kind of option alone (each dispatch-mode save set; the module-level "recompute mlp.act") and
every layer checkpointed. All step times are medians of interleaved rounds of the same step
(`Step(precision="bf16")`, one timer under the interference guard), as ratios to keeping
everything measured in the same rounds; peaks are the planner's measured step peaks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_models import _side_by_side

from benchmarks.publish import publish
from rematlab.core import hostmem
from rematlab.core.recipe import Step
from rematlab.core.units import format_bytes
from rematlab.planning.planner import prepare
from rematlab.plans.plan import Plan, Segment, Selective
from rematlab.remat.strategies import apply
from tests import realzoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    hostmem.own_process()
    torch.manual_seed(0)
    model, batch = realzoo.gpt2(batch=8, seq=256, layers=4, width=256)
    model.train()
    step = Step(precision="bf16", optimizer=torch.optim.AdamW)
    ops = prepare(model, batch, step=step, ops=True)
    layer = prepare(model, batch, step=step)
    c = ops.costs
    n = c.n
    every = {"every layer checkpointed": Plan(n, (0, *[Segment(i, i + 1, (i,))
                                                     for i in range(1, n - 1)], n - 1))}
    for k, opt in enumerate(c.menu(1)):
        every[f"every layer: {opt.name}"] = Plan(
            n, (0, *[Selective.of(i, c.menu(i)[k]) for i in range(1, n - 1)], n - 1))
    floor, full = ops.floor_budget(), ops.full
    rows = []
    for f in (0.25, 0.5, 0.75):
        budget = int(floor + f * (full - floor))
        rows.append((f"{f:.2f} op-level", ops.choose(budget), budget))
        rows.append((f"{f:.2f} per-layer", layer.choose(max(budget, layer.floor_budget())),
                     budget))
    candidates = {name: plan for name, plan, _ in rows} | every
    got, evidence = _side_by_side({k: lambda p=p: apply(model, p)
                                   for k, p in candidates.items()}, batch, model, args.rounds,
                                  step)
    base = got["none"][0]
    lines = ["# Op-level plans under bf16 autocast", "",
             f"Produced by `python benchmarks/op_level_autocast.py --rounds {args.rounds}` "
             f"(module docstring), torch {torch.__version__}, {torch.get_num_threads()} "
             f"threads; timings {'trusted' if evidence.trusted else 'NOT trusted (busy machine)'}.",
             "", "| candidate | budget | plan | measured peak | time / none (± IQR) |",
             "|---|---|---|---|---|"]
    for name, plan in candidates.items():
        budget = next((b for k, _, b in rows if k == name), None)
        peak = ops.measure(plan)
        lines.append(f"| {name} | {format_bytes(budget) if budget else '—'} | "
                     f"`{plan.describe()}` | {format_bytes(peak)} | "
                     f"{got[name][0] / base:.3f}x ±{got[name][1]:.0%} |")
    publish("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
