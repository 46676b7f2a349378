"""Keep, recompute or offload (issue 61): rematlab's plan beside the peers' offloading, all
priced by pre-flight for an H100 (nothing runs on a GPU; fake tensors on this CPU).

    python benchmarks/offload_peers.py --out docs/benchmarks/offload.md

Models: the op-level benchmarks' three transformers (`op_level_autocast.TRANSFORMERS`: 4
layers, width 256, 8 x 256 tokens), GPT-2 with 12 layers of width 1024 at 8 x 1024 tokens
(issue 59's case) and Llama 3.1 8B with LoRA rank 16 at 1 x 8192 tokens
(`examples/llama3.1-8b.json`, bf16 weights); bf16 autocast and AdamW. Each is planned with
`offload=True` on `h100-80gb` (PCIe Gen5, 35 GB/s each way) and on the same card with a
Grace Hopper link (`GH200_LINK`, 170 GB/s out, 411 GB/s in).

The peers, as fixed plans over the same costs (every layer but the last, which the loss's
backward needs first: checkpointed where the peer checkpoints, kept where it does not):
- torchtune's `OffloadActivations` under activation checkpointing, which is what
  transformers' `activation_checkpointing_enable(offload=True)` does (`save_on_cpu` around
  each checkpointed layer: its input moves): every layer "offload input";
- torchtune's `OffloadActivations` without checkpointing (streams on): every layer
  "offload";
- torch's `save_on_cpu` around the step: every layer "offload", its copies synchronous
  (`plans.offload.serialized`).
Beside each, rematlab's fastest plan whose simulated peak is no higher (`plan_for`), and
the time it saves. A peer "fits" when its simulated peak is within the card's budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.op_level_autocast import TRANSFORMERS, bf16_step
from benchmarks.publish import publish
from rematlab.cli.models import hf_model
from rematlab.core.lora import add_lora
from rematlab.core.units import format_bytes
from rematlab.planning.planner import Planning, prepare
from rematlab.planning.predicted import target_budget
from rematlab.plans.offload import offerable, serialized
from rematlab.plans.plan import OFFLOAD, OFFLOAD_INPUT, ChainCosts, Plan, Segment, Selective
from rematlab.plans.simulate import simulate
from rematlab.preflight.targets import GH200_LINK, PROFILES

ROOT = Path(__file__).resolve().parents[1]
H100 = PROFILES["h100-80gb"]
GH200_LIKE = dataclasses.replace(H100, name="h100-80gb with a GH200 link",
                                 host_link=GH200_LINK)
GOAL = 0.10  # rematlab at least 10 % faster than each peer that fits, at its peak


def _meta(make):
    """A model and batch from `make`, on the meta device (pre-flight needs no weights)."""
    model, batch = make()
    return model.to("meta"), {k: v.to("meta") for k, v in batch.items()}


def _gpt2_1024():
    model, _ = hf_model(str(ROOT / "examples/gpt2-12l-1024.json"), meta=True)
    ids = torch.empty(8, 1024, dtype=torch.int64, device="meta")
    return model, {"input_ids": ids, "labels": ids}


def _llama_8b_lora():
    model, _ = hf_model(str(ROOT / "examples/llama3.1-8b.json"), meta=True)
    model = add_lora(model.to(torch.bfloat16), rank=16)
    ids = torch.empty(1, 8192, dtype=torch.int64, device="meta")
    return model, {"input_ids": ids, "labels": ids}


MODELS = {**{name: (lambda make=make: _meta(make)) for name, make in TRANSFORMERS.items()},
          "GPT-2 12x1024, 8x1024": _gpt2_1024, "Llama 3.1 8B LoRA, 1x8192": _llama_8b_lora}


def peers(c: ChainCosts) -> dict[str, tuple[Plan, ChainCosts]]:
    """The peers' plans (module docstring) over `c`, each with the costs it is priced on."""
    n, layers = c.n, offerable(c)
    last = n - 2

    def every(option: str, last_item) -> Plan | None:
        if not all(any(o.name == option for o in c.menu(i)) for i in layers):
            return None  # some layer has no such option (nothing worth moving)
        return Plan(n, (0, *(Selective(i, option) for i in layers), last_item, n - 1))

    found = {
        "torchtune offload + AC / transformers offload=True":
            (every(OFFLOAD_INPUT, Segment(last, last + 1, (last,))), c),
        "torchtune offload, no AC": (every(OFFLOAD, last), c),
        "save_on_cpu": (every(OFFLOAD, last), serialized(c, H100.link)),
    }
    return {k: (p, costs) for k, (p, costs) in found.items() if p is not None}


def bench(name: str, make) -> list[str]:
    model, batch = make()
    step = bf16_step()
    t0 = time.perf_counter()
    plain = prepare(model, batch, predict=True, target=H100, step=step)
    pcie = prepare(model, batch, predict=True, target=H100, step=step, offload=True)
    seconds = time.perf_counter() - t0
    fast = prepare(model, batch, predict=True, target=GH200_LIKE, step=step, offload=True)
    room = target_budget(H100).nbytes
    rows = [f"### {name}", "",
            f"Floor: {format_bytes(plain.floor)} without offload, {format_bytes(pcie.floor)} "
            f"with it ({pcie.floor / plain.floor - 1:+.1%}); keeping everything "
            f"{format_bytes(plain.full)}. Profiled and solved in {seconds:.1f} s (both).", "",
            "| peer | its peak | its step | fits | rematlab at that peak | rematlab's step "
            "| rematlab faster by |", "|---|---|---|---|---|---|---|"]
    for peer, (plan, costs) in peers(pcie.costs).items():
        peak, t = simulate(plan, costs)
        ours = pcie.solution.plan_for(max(peak, pcie.floor))
        gain = t / (ours.predicted_time or t) - 1
        verdict = ("" if gain >= GOAL or peak > room else
                   " (the floor: no plan holds less, and this one is the peer's)"
                   if ours.predicted_peak == pcie.floor else " (under the goal)")
        rows.append(f"| {peer} | {format_bytes(peak)} | {t * 1e3:.1f} ms "
                    f"| {'yes' if peak <= room else 'no'} | `{_short(ours)}` "
                    f"| {(ours.predicted_time or 0) * 1e3:.1f} ms | {gain:+.1%}{verdict} |")
    rows += ["", *_links(plain, pcie, fast), ""]
    return rows


def _short(plan: Plan) -> str:
    kinds = {"kept": 0, "recomputed": 0, "offloaded": 0, "input offloaded": 0}
    for it in plan.items[1:-1]:
        if isinstance(it, Segment):
            kinds["recomputed"] += it.end - it.start
        elif isinstance(it, Selective) and it.option == OFFLOAD_INPUT:
            kinds["input offloaded"] += 1
        elif isinstance(it, Selective) and it.option.startswith(OFFLOAD):
            kinds["offloaded"] += 1
        elif isinstance(it, Selective):
            kinds["recomputed"] += 1
        else:
            kinds["kept"] += 1
    return ", ".join(f"{v} {k}" for k, v in kinds.items() if v)


def _links(plain: Planning, pcie: Planning, fast: Planning) -> list[str]:
    """At budgets a quarter, half and three quarters of the way from the floor to keeping
    everything: the plan without offload, with offload on PCIe, with a Grace Hopper link."""
    rows = ["| budget | without offload | PCIe Gen5 | GH200 link |", "|---|---|---|---|"]
    for share in (0.25, 0.5, 0.75):
        budget = int(plain.floor + share * (plain.full - plain.floor))
        cells = []
        for planning in (plain, pcie, fast):
            plan = planning.solution.plan_for(budget)
            cells.append(f"`{_short(plan)}`, {(plan.predicted_time or 0) * 1e3:.1f} ms")
        rows.append(f"| {format_bytes(budget)} | " + " | ".join(cells) + " |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    args = parser.parse_args()
    started = time.perf_counter()
    lines = ["# Offload beside recomputation, and the peers' offloading", "",
             "Produced by `python benchmarks/offload_peers.py --out docs/benchmarks/offload.md`"
             " on this 2-core CPU: every figure is pre-flight's (fake tensors, the roofline "
             "of `h100-80gb`, its host link), nothing ran on a GPU. What each peer is, and "
             "how it is priced: the module docstring.", ""]
    for name in args.models:
        lines += bench(name, MODELS[name])
        print("\n".join(lines[-12:]), flush=True)
    lines.append(f"Wall time: {time.perf_counter() - started:.0f} s.")
    publish("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
