"""Where planning time goes on long chains (issue 29, step 1), on this machine's CPU.

    .venv/bin/python benchmarks/planning_time.py [--out docs/benchmarks/planning-time.md]

Chains of `Linear(256, 256) + ReLU` blocks, batch 64, 2 threads, one budget at 1.2x the floor,
as the issue states them. Each stage of `rematlab.plan` is timed on its own, in the order the
planner runs them: finding the chain (`structure`), profiling the blocks (`profile_chain`, on
the CPU and on `meta`), the DP (`solve`), reading its Pareto frontier, and choosing with the
measured verification (`Planning.choose`). Wall-clock seconds of one run per stage (these are
durations of work, not step times: one run each, the median of three for the DP).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from rematlab.planning.planner import Planning
from rematlab.plans.solver import solve
from rematlab.remat.chain import profile_chain
from rematlab.remat.structure import structure

LENGTHS = (25, 50, 100)


def _chain(n: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(n)])


def _seconds(work) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = work()
    return time.perf_counter() - t0, out


def row(n: int) -> str:
    torch.manual_seed(0)
    model, x = _chain(n), torch.randn(64, 256)
    t_structure, st = _seconds(lambda: structure(model, x, None))
    t_profile, costs = _seconds(lambda: profile_chain(st.blocks, x, optimizer="momentum",
                                                      repeats=1))
    t_meta, _ = _seconds(lambda: profile_chain(st.blocks, x, device=torch.device("meta"),
                                               optimizer="momentum"))
    dp = []
    for _ in range(3):
        took, solution = _seconds(lambda: solve(costs))
        dp.append(took)
    t_frontier, front = _seconds(lambda: solution.frontier)
    planning = Planning(model, st, x, costs, solution, True, False, None)
    budget = int(1.2 * solution.min_peak)
    t_choose, _ = _seconds(lambda: planning.choose(budget))
    t_again, _ = _seconds(lambda: planning.choose(int(1.3 * solution.min_peak)))
    total = t_structure + t_profile + statistics.median(dp) + t_frontier + t_choose
    return (f"| {n} | {t_structure:.2f} | {t_profile:.2f} | {t_meta:.2f} | "
            f"{statistics.median(dp):.2f} | {t_frontier:.2f} | {len(front)} | {t_choose:.2f} | "
            f"{t_again:.2f} | {total:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    lines = ["| blocks | structure (fx) | profile (CPU) | profile (meta) | DP solve | "
             "frontier | frontier plans | choose, verified | next budget | total |",
             "|---" * 10 + "|"]
    for n in LENGTHS:
        lines.append(row(n))
        print(lines[-1], flush=True)
    text = ("# Where planning time goes on long chains\n\nProduced by `python "
            "benchmarks/planning_time.py --out docs/benchmarks/planning-time.md` (module "
            "docstring: what is timed and how). Seconds, " + time.strftime("%Y-%m-%d")
            + f", torch {torch.__version__}, 2 threads.\n\n" + "\n".join(lines) + "\n")
    if args.out:
        from rematlab.core.files import write_text

        write_text(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
