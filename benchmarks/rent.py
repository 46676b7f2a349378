"""`rematlab rent` (issue 60): how long the 8B case takes, and its time figures beside every
published training run that gives a time.

    python benchmarks/rent.py --out docs/benchmarks/rent.md

1. Speed: Llama 3.1 8B (`examples/llama3.1-8b.json`, built on the meta device), sequence
   8192, batch 2 per rank, bf16 autocast, AdamW, 10^10 tokens, over every card profile at 1,
   2, 4 and 8 cards, the largest batch included: `rent()` timed whole, then the README's
   command timed as a user runs it (a fresh process: imports, the model built, the table
   printed). The machine's foreign load over each is said beside it.
2. Time against what was measured: each predictable row of `tests/data/published/runs.json`
   that publishes tokens per second per GPU, priced by `rent()` on the row's own card (its
   data-sheet profile with what the source says of the card: a 96 GB, 500 W H100 for
   torchtitan's) at the row's count, model, batch, sequence and step. Beside it, pre-flight's
   price of the peer's own checkpointing (`tests/published.py`): `rent` picks its own plan,
   so its row may be faster than the run the project published.

Nothing runs on a GPU: every figure is pre-flight's, from fake tensors on this CPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rematlab.cli.models import hf_model
from rematlab.core.guard import HostLoad
from rematlab.core.recipe import Step
from rematlab.planning.rent import COUNTS, Rental, RentResult, Work, rent
from rematlab.preflight.shared import shared_runs
from tests import published

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["rent", "--model", "hf:examples/llama3.1-8b.json", "--input-shape", "8192",
           "--batch", "2", "--tokens", "1e10"]
GOAL = 0.15
T = TypeVar("T")


def _loaded(fn: Callable[[], T]) -> tuple[T, float, float | None]:
    """`fn()`, its wall seconds, and other processes' share of this process's CPUs meanwhile."""
    host = HostLoad()
    host.start()
    started = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - started
    load = host.stop()
    return out, seconds, load


def _load(load: float | None) -> str:
    return "unknown" if load is None else f"{load:.0%}"


def _speed() -> tuple[list[str], RentResult]:
    net, vocab = hf_model(str(ROOT / "examples/llama3.1-8b.json"), meta=True)
    batch = (torch.randint(0, vocab, (2, 8192), device="meta"),)
    step = Step(precision="bf16", optimizer=torch.optim.AdamW)
    result, seconds, load = _loaded(lambda: rent(net, batch, work=Work(tokens=10**10),
                                                 step=step, counts=COUNTS))
    cli = [sys.executable, "-m", "rematlab", *COMMAND]
    begun = time.perf_counter()
    done = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, check=False,
                          env={**os.environ, "COLUMNS": "150"})  # the table unwrapped
    cli_s = time.perf_counter() - begun
    rows = len(result.rows)
    lines = ["## Speed", "",
             f"- `rent()` in this process: {rows} configurations in {seconds:.1f} s "
             f"(foreign load {_load(load)}).",
             f"- `rematlab {' '.join(COMMAND)}` in a fresh process: {cli_s:.1f} s wall, exit "
             f"{done.returncode}.", "",
             "What it printed:", "", "```", done.stdout.rstrip(), "```"]
    return lines, result


def _per_gpu(row: Rental) -> float | None:
    return None if row.per_s is None else row.per_s / row.count


def _against_published() -> list[str]:
    lines = ["## Time against published runs", "",
             "| row | card x count | rent's plan | rent tokens/s/GPU | published | error "
             "| the peer's plan priced | error |", "|---|---|---|---|---|---|---|---|"]
    worst = 0.0
    for row in published.rows(predictable=True):
        measured = row["measured"].get("tokens_per_s_per_gpu")
        if measured is None:
            continue
        model, batch = published.model_and_batch(row)
        count = 1 if row["layout"] is None else row["layout"]["world_size"]
        target = published.target(row)
        result = rent(model, batch, work=Work(tokens=10**9), step=published.step(row),
                      cards=[target], counts=[count], largest=False)
        got = result.rows[0]
        peer = published.replay(row)
        mine = _per_gpu(got)
        error = None if mine is None else mine / measured - 1
        worst = max(worst, abs(error or 0.0))
        lines.append(
            f"| {row['id']} | {target.name} x {count} "
            f"| {f'{got.recomputed} of {got.blocks} layers recomputed' if got.fits else got.why} "
            f"| {'' if mine is None else f'{mine:,.0f}'} | {measured:,} "
            f"| {'' if error is None else f'{error:+.1%}'} "
            f"| {peer.tokens_per_s:,.0f} (`{row['checkpointing']}`) "
            f"| {peer.tokens_error:+.1%} |")
    lines += ["", f"Largest error of a rent row: {worst:.1%} (goal: within {GOAL:.0%}). The "
              "H200 facts (`tests/data/gpu/h200-torch2.11`) record peaks, not step times, so "
              "they give no time to check."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the Markdown page here")
    args = parser.parse_args()
    started = time.perf_counter()
    head = ["# `rematlab rent`: speed, and time against published runs", "",
            "Produced by `python benchmarks/rent.py --out docs/benchmarks/rent.md` on this "
            "2-core CPU (module docstring: what and how). Nothing runs on a GPU.", ""]
    speed, _ = _speed()
    with shared_runs():
        checked = _against_published()
    text = "\n".join([*head, *speed, "", *checked, "",
                      f"Wall time: {time.perf_counter() - started:.0f} s."]) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
