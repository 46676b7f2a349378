"""Plans for the step users run under bf16 autocast: the autocast-aware plan
(`rematlab.Step(precision="bf16")`) against the plan made for rematlab's fp32 step at the same
budget, both run in the user's own autocast loop.

    python benchmarks/mixed_precision.py [--quick] [--out docs/benchmarks/mixed-precision.md]

Models: GPT-2 and Llama from transformers configs (tests/realzoo.py), AdamW, bf16 autocast
around forward and loss, backward outside it, as HF Trainer, Lightning and Accelerate run it.
Budgets: the autocast-aware planning's floor, the middle, and its unconstrained peak. The fp32
planning is told the same budget; below its own floor it has no plan (a user who asked for
one would get `InfeasibleBudgetError`). Peaks: the live-storage tracker (identical to torch's
MemTracker where both run) around the user's autocast loop, the optimizer step included.
Times: each plan's training step (one micro-batch, the optimizer step included) over the
autocast loop without checkpointing, measured side by side in one process (interleaved rounds
by the one timer, under the interference guard), median over rounds with the spread (IQR /
median) of each candidate.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rematlab.core import hostmem
from rematlab.core.recipe import Step
from rematlab.core.timer import Timer
from rematlab.core.units import format_bytes
from rematlab.exceptions import InfeasibleBudgetError
from rematlab.planning.planner import prepare
from rematlab.remat.strategies import apply
from tests import realzoo
from tests.meters import user_loop_peak

SIZES = {"gpt2": {"batch": 8, "seq": 128, "layers": 8, "width": 128},
         "llama": {"batch": 8, "seq": 128, "layers": 8, "width": 128}}
QUICK = {"gpt2": {"batch": 4, "seq": 64, "layers": 4, "width": 64},
         "llama": {"batch": 4, "seq": 64, "layers": 4, "width": 64}}
FRACTIONS = (0.0, 0.5, 1.0)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def _times(model, runs: dict, batch, rounds: int) -> dict[str, tuple[float, float]]:
    """Median step seconds and spread of each run in the user's bf16 loop, side by side."""
    step = Step(precision="bf16", optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-4})
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt = step.make_optimizer(model.parameters())

    def work(run):
        return lambda clock: step.train_step(model, batch, run=run, optimizer=opt, clock=clock)

    timing = Timer(torch.device("cpu")).run({n: work(r) for n, r in runs.items()}, rounds,
                                            warmup=1)
    model.load_state_dict(state)
    return {n: (timing.median(n), timing.iqr(n) / timing.median(n)) for n in runs}


def bench(name: str, sizes: dict, rounds: int) -> list[str]:
    torch.manual_seed(0)
    model, batch = getattr(realzoo, name)(**sizes)
    model.train()
    aware_step = Step(precision="bf16", optimizer=torch.optim.AdamW,
                      optimizer_kwargs={"lr": 1e-4})
    t0 = time.perf_counter()
    aware = prepare(model, batch, step=aware_step)
    planning_s = time.perf_counter() - t0
    fp32 = prepare(model, batch, step=Step(optimizer=torch.optim.AdamW,
                                           optimizer_kwargs={"lr": 1e-4}))
    floor, full = aware.floor_budget(), aware.full
    plain = user_loop_peak(model, batch, precision="bf16", optimizer=_adamw, meter="live")
    lines = [f"**{name}** ({sizes}): autocast-aware floor {format_bytes(floor)}, "
             f"unconstrained {format_bytes(full)}; the plain autocast loop peaks at "
             f"{format_bytes(plain)}; fp32 planning's floor {format_bytes(fp32.floor_budget())}"
             f"; autocast-aware profiling and solving took {planning_s:.1f} s.", "",
             "| budget | plan | layers ckpt | autocast-loop peak | use | time × none (spread) |",
             "|---|---|---|---|---|---|"]
    runs, rows = {"none": model}, []
    for frac in FRACTIONS:
        budget = int(floor + frac * (max(full, plain) - floor))
        for kind, planning in (("autocast-aware", aware), ("fp32", fp32)):
            try:
                chosen = planning.choose(budget)
            except InfeasibleBudgetError:
                rows.append((budget, kind, None, None, None))
                continue
            planned = apply(model, chosen)
            peak = user_loop_peak(planned, batch, precision="bf16", optimizer=_adamw,
                                  meter="live")
            key = f"{kind}@{frac:g}"
            runs[key] = planned
            rows.append((budget, kind, chosen, peak, key))
    times = _times(model, runs, batch, rounds)
    base = times["none"][0]
    for budget, kind, chosen, peak, key in rows:
        if chosen is None:
            lines.append(f"| {format_bytes(budget)} | {kind}: infeasible (below its floor) "
                         "| | | | |")
            continue
        t, spread = times[key]
        lines.append(f"| {format_bytes(budget)} | {kind}: `{chosen.describe()}` | "
                     f"{len(chosen.segments)} | {format_bytes(peak)} | {peak / budget:.1%} | "
                     f"{t / base:.3f} ({spread:.1%}) |")
    lines.append(f"\nnone: {base * 1e3:.1f} ms per step (spread {times['none'][1]:.1%}).\n")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    hostmem.retain_freed_memory()
    host = hostmem.describe()
    torch.set_num_threads(2)
    sizes = QUICK if args.quick else SIZES
    command = "python benchmarks/mixed_precision.py" + (" --quick" if args.quick else "")
    lines = ["# Mixed precision: plans for the user's autocast step", "",
             f"`{command}`, {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads; host memory: {host}.", "",
             __doc__.split("\n\n", 2)[2].strip(), ""]
    for name in sizes:
        lines += bench(name, sizes[name], args.rounds)
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
