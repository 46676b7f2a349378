"""The cost of dynamic padding for `rematlab.auto`: a training run whose batches each have a
new length, with shape buckets (a plan per power-of-two bucket of lengths) and without (a
plan per exact shape), beside the same run with no checkpointing.

    python benchmarks/dynamic_shapes.py [--quick] [--out docs/benchmarks/dynamic-shapes.md]

Model: GPT-2 from a transformers config (tests/realzoo.py), momentum SGD, batches as a
dynamic-padding collator makes them (each as long as its longest row, lengths drawn from
40-128, the same draw for every candidate). Budget: halfway between the floor and the
unconstrained peak at the longest length. Each candidate is one whole run from a fresh
`auto` wrapper and fresh weights, planning included; the runs are timed side by side by the
one timer (interleaved rounds under the interference guard, one warm-up run each), median
and spread (IQR / median) over rounds. Also per run: how many times it planned, and the
seconds of the steps that planned (profiling, verifying and the step itself). That every
step that did not plan keeps the budget is `tests/test_shapes.py`'s.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.publish import publish
from rematlab.core import hostmem
from rematlab.core.batch import call
from rematlab.core.steps import default_loss
from rematlab.core.timer import Timer
from rematlab.core.units import format_bytes
from rematlab.exceptions import InfeasibleBudgetError
from rematlab.planning.auto import auto
from rematlab.planning.planner import prepare
from tests import realzoo

SIZES = {"batch": 8, "layers": 6, "width": 128, "steps": 40}
QUICK = {"batch": 4, "layers": 4, "width": 64, "steps": 20}


def run(state: dict, data: list[dict], budget: int, mode: str, seen: dict):
    """One training run as work for the timer: fresh weights, a fresh wrapper."""
    def work(clock) -> dict[str, float]:
        torch.manual_seed(0)
        model, _ = realzoo.gpt2(seq=128, layers=SIZES["layers"], width=SIZES["width"])
        model.load_state_dict(state)
        model.train()
        net = model if mode == "none" else auto(model, budget,
                                                shape_buckets=mode == "buckets")
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        planning = 0.0
        clock.start()
        for batch in data:
            before = getattr(net, "planned", 0)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            default_loss(call(net, batch), batch).backward()
            opt.step()
            if getattr(net, "planned", 0) > before:
                planning += time.perf_counter() - t0
        total = clock.stop()
        seen[mode] = getattr(net, "planned", 0)
        return {"step": total, "planning": planning}
    return work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    opts = parser.parse_args()
    if opts.quick:
        SIZES.update(QUICK)
    hostmem.retain_freed_memory()
    torch.manual_seed(0)
    model, longest = realzoo.gpt2(batch=SIZES["batch"], seq=128, layers=SIZES["layers"],
                                  width=SIZES["width"])
    model.train()
    planning = prepare(model, longest)
    try:
        planning.choose(1)
    except InfeasibleBudgetError as err:
        floor = err.min_peak
    budget = (floor + planning.choose("100GiB").measured_peak) // 2
    data = realzoo.padded_batches(SIZES["steps"], SIZES["batch"])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    seen: dict[str, int] = {}
    modes = {"none": "no checkpointing", "buckets": "auto, shape buckets",
             "exact": "auto, a plan per exact shape"}
    timing = Timer(torch.device("cpu"), min_repeat_s=0.0).run(
        {m: run(state, data, budget, m, seen) for m in modes}, opts.rounds, warmup=1)
    none = timing.median("none")
    rows = []
    for mode, label in modes.items():
        total, spread = timing.median(mode), timing.iqr(mode) / timing.median(mode)
        plan_s = timing.median(mode, "planning")
        rows.append(f"| {label} | {seen[mode]} | {total:.1f} s ({spread:.1%}) | "
                    f"{total / none:.2f}x | {plan_s:.1f} s |")
    lengths = sorted({b["input_ids"].shape[1] for b in data})
    text = "\n".join([
        "# Dynamic padding: shape buckets in `rematlab.auto`",
        "",
        f"`python benchmarks/dynamic_shapes.py{' --quick' if opts.quick else ''}`, "
        f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; host memory: {hostmem.describe()}; the guard "
        f"{'trusted' if timing.evidence.trusted else 'did not trust'} the rounds.",
        "",
        __doc__.split("\n\n", 2)[2].strip(),
        "",
        f"GPT-2 {SIZES['layers']} layers, width {SIZES['width']}, batch {SIZES['batch']}, "
        f"{SIZES['steps']} steps with {len(lengths)} distinct lengths ({lengths[0]}-"
        f"{lengths[-1]}); budget {format_bytes(budget)} (floor {format_bytes(floor)} at 128 "
        "tokens).",
        "",
        "| run | plans made | run time (spread) | × no checkpointing | in the steps that "
        "planned |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ])
    publish(text, opts.out)


if __name__ == "__main__":
    main()
