"""Planning time against chain length (issue 29): where it goes, and what one more budget costs.

    .venv/bin/python benchmarks/planner.py --scale   # writes the section into planner.md

Chains of `Linear(256, 256) + ReLU` blocks, 2 threads, at batch 64 (the issue's setting: the
optimizer step's peak dominates and the frontier is one plan) and batch 2048 (activations
dominate: a frontier of hundreds of plans, the solver's hard case). Each stage of
`rematlab.prepare` / `Planning.choose` is timed on its own, in the order the planner runs
them: finding the chain (`structure`), profiling the blocks on the CPU (`profile_chain`,
identical blocks profiled once) or predicting them on `meta`, the DP (`solve`), reading its
Pareto frontier, choosing with the measured verification at 1.2x the floor, and then another
budget (1.3x the floor) verified and predicted (a lookup). Also the DP alone on random
heterogeneous chains, where no two blocks are alike and no sub-chain is shared.

These are durations of one-off work, not step times: the DP and frontier are the median of
three runs, the other stages one run each (profiling's own timer repeats inside it).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from rematlab.core.recipe import Step
from rematlab.exceptions import InfeasibleBudgetError
from rematlab.planning.planner import Planning
from rematlab.plans.fixed import none_plan
from rematlab.plans.plan import ChainCosts
from rematlab.plans.simulate import simulate
from rematlab.plans.solver import Solution, solve
from rematlab.remat.chain import profile_chain
from rematlab.remat.profiling import Profiling
from rematlab.remat.structure import structure

LENGTHS = (25, 50, 100, 200, 400)
HETEROGENEOUS = (25, 50, 100)
ACCURACY_UP_TO = 50  # the exact DP takes minutes beyond


def _chain(n: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(n)])


def _seconds(work: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = work()
    return time.perf_counter() - t0, out


def _median_solve(costs: ChainCosts, layers: bool = False) -> tuple[float, float, Solution]:
    """Median seconds of the DP and of reading its frontier, over three fresh solves."""
    dp, front = [], []
    for _ in range(3):
        took, solution = _seconds(lambda: solve(costs, layers=layers))
        dp.append(took)
        front.append(_seconds(lambda s=solution: s.frontier)[0])
    return statistics.median(dp), statistics.median(front), solution


def row(n: int, batch: int) -> str:
    torch.manual_seed(0)
    model, x = _chain(n), torch.randn(batch, 256)
    t_structure, st = _seconds(lambda: structure(model, x, None))
    t_profile, costs = _seconds(lambda: profile_chain(st.blocks, x, Profiling(repeats=1)))
    t_meta, _ = _seconds(lambda: profile_chain(st.blocks, x, device=torch.device("meta")))
    t_dp, t_frontier, solution = _median_solve(costs)
    planning = Planning(model, st, x, costs, solution, verify=True, compile=False,
                        step=Step())
    t_choose, _ = _seconds(lambda: planning.choose(int(1.2 * solution.min_peak)))
    t_next, _ = _seconds(lambda: planning.choose(int(1.3 * solution.min_peak)))
    predicting = Planning(model, st, x, costs, solution, verify=False, compile=False,
                          step=Step())
    t_lookup, _ = _seconds(lambda: predicting.choose(int(1.3 * solution.min_peak)))
    solving = t_dp + t_frontier
    total = t_structure + t_profile + solving + t_choose
    return (f"| {n} | {batch} | {t_structure:.2f} | {t_profile:.2f} | {t_meta:.2f} | "
            f"{t_dp:.2f} | {t_frontier:.2f} | {len(solution.frontier)} | "
            f"{int(solution.ids.max())} | {solution.levels} | {t_choose:.2f} | {t_next:.2f} | "
            f"{t_lookup:.3f} | {solving:.2f} | **{total:.2f}** |")


def heterogeneous(n: int, seed: int = 0) -> ChainCosts:
    """Random costs with no two blocks alike (bytes in 4 KiB pages, times in ms)."""
    rng = random.Random(seed)
    page = 4096

    def pages(hi: int, lo: int = 0) -> list[int]:
        return [rng.randint(lo, hi) * page for _ in range(n)]

    return ChainCosts(
        x=[rng.randint(1, 600) * page for _ in range(n + 1)], saved=pages(500),
        keeps_input=[rng.random() < 0.7 for _ in range(n)],
        keeps_output=[rng.random() < 0.5 for _ in range(n)],
        fwd_mem=pages(600, 1), bwd_mem=pages(800, 1), grad=pages(300),
        fwd_time=[rng.uniform(1e-3, 9e-3) for _ in range(n)],
        bwd_time=[rng.uniform(1e-3, 9e-3) for _ in range(n)])


def heterogeneous_row(n: int) -> str:
    costs = heterogeneous(n)
    t_dp, t_frontier, solution = _median_solve(costs)
    return (f"| {n} | {int(solution.ids.max())} | {solution.levels} | {t_dp:.2f} | "
            f"{t_frontier:.2f} | {len(solution.frontier)} | "
            + (_accuracy(costs, solution) if n <= ACCURACY_UP_TO else "not checked") + " |")


def _accuracy(costs: ChainCosts, solution: Solution) -> str:
    """The solver's stated accuracy against the exact DP (unit = the 4 KiB page every term
    is a multiple of): the floor's excess, and the worst time of the plan for B against the
    exact optimum for 0.995 B, over 200 budgets from the floor to keeping everything."""
    exact = solve(costs, unit=4096)
    full = simulate(none_plan(costs.n), costs)[0]
    worst = 0.0
    for budget in np.linspace(solution.min_peak, full, 200).astype(int):
        try:
            best = exact.plan_for(int(0.995 * budget)).predicted_time or 1.0
        except InfeasibleBudgetError:
            continue
        worst = max(worst, (solution.plan_for(int(budget)).predicted_time or 0.0) / best - 1)
    return (f"floor +{solution.min_peak / exact.min_peak - 1:.3%}, time at B vs optimum at "
            f"0.995 B: +{worst:.3%} worst")


def deep_decoder(layers: int = 80) -> str:
    """Issue 29's pre-flight case: a `layers`-layer Llama-style decoder built on the meta
    device (width 1024, 16 heads, 4 key/value heads, bf16, sequence 1024, batch 1), planned
    for an H100 with an op-level menu per layer: `prepare(predict=True,
    target="h100-80gb", ops=True)` (the fake twin profiled, one layer's menu, the DP) and one
    choice at 1.2x the floor. The DP and frontier are also timed alone on the same costs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rematlab.planning.planner import prepare

    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=1024, intermediate_size=2816,
                      num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                      max_position_embeddings=2048)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).train()
    ids = torch.empty(1, 1024, dtype=torch.int64, device="meta")
    t_prep, planning = _seconds(lambda: prepare(model, {"input_ids": ids, "labels": ids},
                                                predict=True, target="h100-80gb", ops=True))
    t_choose, _ = _seconds(lambda: planning.choose(int(1.2 * planning.floor_budget())))
    t_dp, t_front, solution = _median_solve(planning.costs, layers=True)
    options = len(planning.costs.menu(1))
    return (f"| {layers} | {options} + keep + checkpoint | {t_prep:.1f} | {t_dp + t_front:.2f} | "
            f"{t_choose:.2f} | {t_prep + t_choose:.1f} | {len(solution.frontier)} |")


def section() -> str:
    """The markdown section: both tables, printed row by row as they are measured."""
    torch.set_num_threads(2)
    lines = ["## Planning at scale", "",
             "Produced by `python benchmarks/planner.py --scale` (`benchmarks/planner_scale.py`"
             ": what is timed and how). Seconds, " + time.strftime("%Y-%m-%d")
             + f", torch {torch.__version__}, 2 threads, this 2-core machine. *Total* is "
             "planning with profiling and the verified choice at 1.2x the floor; *next "
             "budget* is one more budget from the same `prepare` (verified: measured; "
             "predicted: a lookup).", "",
             "| blocks | batch | structure (fx) | profile (CPU) | profile (meta) | DP | "
             "frontier | frontier plans | distinct sub-chains | levels | choose, verified | "
             "next budget, verified | next budget, predicted | DP + frontier | total |",
             "|---" * 15 + "|"]
    for batch in (64, 2048):
        for n in LENGTHS:
            lines.append(row(n, batch))
            print(lines[-1], flush=True)
    lines += ["", "The DP alone on random heterogeneous chains (no two blocks alike, so "
              "every sub-chain is distinct and the work grows as n³ x levels; the levels "
              "shrink to keep it near a second, see `solver.affordable_levels`):", "",
              "| blocks | distinct sub-chains | levels | DP | frontier | frontier plans | "
              "against the exact DP |", "|---" * 7 + "|"]
    for n in HETEROGENEOUS:
        lines.append(heterogeneous_row(n))
        print(lines[-1], flush=True)
    lines += ["", "Pre-flight of a deep decoder, every layer with its op-level menu "
              "(`deep_decoder`: an 80-layer Llama-style model on the meta device, planned for "
              "an H100; *prepare* profiles its fake twin through three- and four-layer "
              "twins (`rematlab.remat.shorten`), builds one layer's menu and solves):",
              "", "| layers | choices per layer | prepare (pre-flight) | DP + frontier alone | "
              "choose | total | frontier plans |", "|---" * 7 + "|", deep_decoder()]
    print(lines[-1], flush=True)
    return "\n".join(lines) + "\n"
