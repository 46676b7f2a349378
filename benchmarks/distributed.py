"""Per-rank plans under FSDP2 (issue 37): measured against predicted on this CPU, and a
Llama-3-8B-shaped model planned for 8 x H100-80GB.

Part 1. GPT-2 (4 layers, width 128, 4 x 64 tokens, AdamW) under FSDP2 on real gloo ranks
(1, 2, 4 processes, loopback): plans at the per-rank floor, midway and unconstrained, each
rank's peak metered by torch's `FSDPMemTracker` in the user's own loop (`tests/ranks.py`),
against the same plans' per-rank peaks predicted in this process on a fake process group of
the same size.

Part 2. Llama 3 8B's shapes on the meta device, predicted for 8 x H100-80GB: full fine-tuning
(fp32 parameters sharded, `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, fp32
AdamW state) and LoRA r16 (bf16 frozen weights), 4096-token sequences: the per-rank floor, the
plan for the card's budget and what one rank holds at its peak, with the wall time and this
process's host memory high-water mark for each setting.

    .venv/bin/python benchmarks/distributed.py --out docs/benchmarks/distributed.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rematlab
from benchmarks.preflight import _hwm, _hwm_reset, _tokens, llama3_8b
from benchmarks.publish import publish
from rematlab import FSDP, Plan, Step
from rematlab.core import hostmem
from rematlab.core.units import format_bytes
from tests import ranks


def part_one() -> list[str]:
    rows = ["| ranks | budget | plan | measured per rank (FSDPMemTracker, largest rank) | "
            "predicted (fake group) | error |", "|---" * 6 + "|"]
    for world in (1, 2, 4):
        with tempfile.TemporaryDirectory() as d:
            found = ranks.spawn(ranks.fsdp_worker, world, Path(d), ["gpt2"])
        model, batch = ranks.made("gpt2")
        planning = rematlab.prepare(model, batch, predict=True, target="cpu",
                                    step=Step(optimizer=torch.optim.AdamW, layout=FSDP(world)))
        for i, row in enumerate(found[0]["gpt2"]["rows"]):
            measured = max(r["gpt2"]["rows"][i]["user"] for r in found)
            predicted = planning.rank(Plan.from_json(row["plan"])).peak
            plan = Plan.from_json(row["plan"])
            rows.append(f"| {world} | {format_bytes(row['budget'])} | {plan.describe()} | "
                        f"{format_bytes(measured)} | {format_bytes(predicted)} | "
                        f"{(predicted - measured) / measured:+.2%} |")
            print(rows[-1], flush=True)
    return rows


def part_two() -> list[str]:
    rows = ["| setting | tokens per rank | per-rank floor | plan for the card (auto budget) | "
            "its per-rank peak | held at the peak | wall | host memory (VmHWM) |",
            "|---" * 8 + "|"]
    settings = [("full fine-tuning", 1), ("full fine-tuning", 4), ("LoRA r16", 4)]
    for setting, batch in settings:
        _hwm_reset()
        t0 = time.perf_counter()
        lora = setting.startswith("LoRA")
        model = llama3_8b(lora=lora)
        layout = FSDP(8) if lora else FSDP(8, param_dtype="bf16", reduce_dtype="fp32")
        if not lora:
            model = model.float()  # fp32 master weights, gathered in bf16
        planning = rematlab.prepare(model, _tokens(batch), predict=True, target="h100-80gb",
                                    step=Step(optimizer=torch.optim.AdamW, layout=layout))
        floor = planning.floor_budget()
        budget = planning.budget("auto")
        chosen = planning.choose(budget.nbytes)
        found = planning.rank(chosen)
        kept = sum(1 for i in chosen.items if isinstance(i, int)) - 2
        held = ", ".join(f"{k} {format_bytes(v)}" for k, v in found.breakdown.items())
        wall = time.perf_counter() - t0
        rows.append(f"| {setting} | {batch} x 4096 | {format_bytes(floor)} | "
                    f"{32 - kept} of 32 layers checkpointed (budget "
                    f"{format_bytes(budget.nbytes)}) | {format_bytes(found.peak)} | {held} | "
                    f"{wall:.0f} s | {format_bytes(_hwm())} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    hostmem.retain_freed_memory()
    big = part_two()
    small = part_one()
    publish("\n".join([
        "# Per-rank plans under FSDP2: measured and predicted",
        "",
        "Command: `.venv/bin/python benchmarks/distributed.py --out "
        "docs/benchmarks/distributed.md` (2-core CPU, torch 2.13.0+cpu, no GPU).",
        "",
        "## GPT-2 under FSDP2 on gloo ranks, against the fake-group prediction",
        "",
        "Each plan was chosen by `rematlab.prepare(..., step=Step(layout=FSDP()))` on the ranks "
        "themselves, then run in the user's own loop (`rematlab.apply`, `fully_shard` on each "
        "layer and the root, AdamW) and metered by torch's `FSDPMemTracker` on every rank. "
        "The prediction ran in one process on a fake process group of the same size.",
        "",
        *small,
        "",
        "## Llama-3-8B-shaped, planned for 8 x H100-80GB from this CPU",
        "",
        "Nothing was allocated: the model is built on the meta device; each candidate plan's "
        "rank step runs on fake tensors, sharded by FSDP2 on a fake group of 8. The budget is "
        "the card's (81,090 MiB as torch reports an H100, less the CUDA context and a 5 % "
        "margin); a rank's plan is held to it by its allocated peak (the caching allocator's "
        "replay, `Planning.card`, is for one device). "
        "Full fine-tuning holds about 15 GiB of shards per rank (fp32 parameters 1/8, fp32 "
        "AdamW state 1/8; the gradients' shards appear in backward). AdamW runs its "
        "multi-tensor (`foreach`) update, torch's default on CUDA, whose temporaries over "
        "every shard at once make the optimizer step the floor at one sequence per rank.",
        "",
        *big,
        "",
    ]), args.out)


if __name__ == "__main__":
    main()
