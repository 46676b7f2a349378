"""What `ops=True` costs in planning time and what it buys in the simulated step, under bf16
autocast on this CPU (issue 50, item 4: should op-level options be the default?).

    .venv/bin/python benchmarks/op_level_planning.py [--rounds 3]
        [--out docs/benchmarks/op-level-planning.md]

GPT-2, a Llama-style decoder and BERT (4 layers, width 256, 8 x 256 tokens), AdamW in bf16
autocast. Each round profiles the model with and without op-level menus
(`prepare(..., ops=True)` against `prepare(...)`, the two interleaved, round after round);
the planning-time ratio is the median of the rounds' ratios. At five budgets between the
per-layer floor and keeping everything, both plannings choose (`verify=False`: the
simulated step, so the comparison is of the planner's own figures, which earlier runs
matched to measured steps within 1-2 %, `docs/benchmarks/op-level-autocast.md`), and the
table gives each plan's simulated time over the plain step's.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from op_level_autocast import FRACTIONS, TRANSFORMERS, bf16_main

from rematlab.core.recipe import Step
from rematlab.planning.planner import prepare
from rematlab.plans.fixed import none_plan
from rematlab.plans.simulate import simulate


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench(name: str, make, step: Step, rounds: int) -> list[str]:
    torch.manual_seed(0)
    model, batch = make()
    model.train()
    ratios, seconds = [], {"ops": [], "layers": []}
    for _ in range(rounds):
        t_ops, ops = _timed(lambda: prepare(model, batch, step=step, ops=True, verify=False))
        t_layers, layers = _timed(lambda: prepare(model, batch, step=step, verify=False))
        seconds["ops"].append(t_ops)
        seconds["layers"].append(t_layers)
        ratios.append(t_ops / t_layers)
    _, plain = simulate(none_plan(layers.costs.n), layers.costs)
    floor, full = layers.floor_budget(), layers.full
    rows = [f"### {name}", "",
            f"Planning time: with op-level menus {statistics.median(seconds['ops']):.1f} s, "
            f"without {statistics.median(seconds['layers']):.1f} s: "
            f"**{statistics.median(ratios):.2f}x** (median of {rounds} interleaved rounds).",
            "", "| budget | op-level plan | simulated time / plain | per-layer plan | "
            "simulated time / plain |", "|---|---|---|---|---|"]
    for f in FRACTIONS:
        budget = int(floor + f * (full - floor))
        a, b = ops.choose(budget), layers.choose(budget)
        rows.append(f"| {f:.1f} | `{a.describe()}` | {a.predicted_time / plain:.3f}x | "
                    f"`{b.describe()}` | {b.predicted_time / plain:.3f}x |")
    return [*rows, ""]


def main() -> None:
    bf16_main(__doc__, "Op-level menus: planning time and what they buy (bf16 autocast)",
              "op_level_planning.py", bench, TRANSFORMERS, rounds=3, own_memory=False)


if __name__ == "__main__":
    main()
