"""How long a grid takes on a GPU that is not here (issue 51): the sum, over its
configurations, of the steps the measurement runs, each timed by pre-flight on the card's
profile, and the harness's own seconds per configuration.

    python scripts/gpu_grid_estimate.py [--grid seed-study-gpu] [--target h200] [--harness-s 0.09]

Per (model, input, batch, dtype, optimizer) the step is predicted once on the target's
roofline (`rematlab.prepare(..., predict=True, target=...)`, built on the meta device), and
each strategy's time from those costs (`simulate`). A configuration runs `warmup` untimed
steps, the tracked one (peak) first, then, once per shape, the step that counts FLOPs (a real
step wherever one takes under `FAKE_COUNT_S`, as a GPU's do), then `repeats` repeats, each
of at least `min_repeat_s` of steps and the guard's calibration kernel. `--harness-s` is what
a warm
worker spends per configuration outside its steps (building the model, counting, writing the
row): measured on the 2-core CPU as (wall - measured - waited - the worker's start) /
configurations of the dry run's 24-configuration MLP-3 / LeNet-5 grid through the sweep
(`min_repeat_s` 5 ms): 2.1 s / 24 = 0.09 s on 2026-12-04; a GPU host's faster cores take less.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rematlab.core.recipe import Step
from rematlab.measurement import zoo
from rematlab.measurement.measure import FAKE_COUNT_S, count_key
from rematlab.planning.planner import prepare
from rematlab.plans.simulate import simulate
from rematlab.remat.strategies import parse
from rematlab.study.grid import load_grid

CALIBRATION_S = 0.5e-3  # the guard's GPU calibration kernel per repeat (16 products, 1024²)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", default="seed-study-gpu")
    parser.add_argument("--target", default="h200")
    parser.add_argument("--harness-s", type=float, default=0.09)
    args = parser.parse_args()
    grid = load_grid(args.grid)
    least = grid.min_repeat_s if grid.min_repeat_s is not None else 0.2
    costs: dict[tuple, object] = {}
    seconds: dict[str, float] = defaultdict(float)
    shapes: set[tuple] = set()
    for spec in grid.expand():
        key = (spec.model, spec.input, spec.batch, spec.dtype, spec.optimizer)
        if key not in costs:
            net, shape, _ = zoo.resolve(spec.model, spec.input)
            net = net.to(getattr(torch, spec.dtype))
            with torch.device("meta"):
                x = torch.empty(spec.batch, *shape, dtype=getattr(torch, spec.dtype))
            costs[key] = prepare(net, x, predict=True, target=args.target,
                                 step=Step(optimizer=spec.optimizer)).costs
        c = costs[key]
        strat = parse(spec.strategy)
        step_s = simulate(strat.build(c.n, c if strat.needs_costs else None), c)[1]
        calls = max(1, math.ceil(least / step_s)) if step_s > 0 else 1
        # untimed: the tracked step, warmup - 1 more, and the count once per shape (real
        # where a step is fast: the fake twin's count is host time, inside the harness)
        shape = count_key(spec)  # what the protocol counts once
        counted = step_s if shape not in shapes and step_s < FAKE_COUNT_S else 0.0
        shapes.add(shape)
        run_s = (spec.warmup * step_s + counted
                 + spec.repeats * (calls * step_s + CALIBRATION_S))
        seconds[spec.model + (f"/{spec.input}" if spec.input else "")] += run_s
    total_steps = sum(seconds.values())
    harness = args.harness_s * grid.size()
    for name, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"{name:18s} {s:8.1f} s of steps")
    print(f"{grid.size()} configurations on {args.target}: {total_steps:.0f} s of steps + "
          f"{harness:.0f} s of harness ({args.harness_s:g} s each) = "
          f"{(total_steps + harness) / 60:.1f} min")


if __name__ == "__main__":
    main()
