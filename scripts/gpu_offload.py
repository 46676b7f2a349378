"""Offload facts (issue 61), one step of `gpu_check.sh`: a GPT-2 planned with offload on the
GPU here at two budgets, each plan with its simulated peak, its measured peak (the planner's
own verification), its measured step time beside the plain step's, and the host bytes it
pinned; and the same model pre-flighted for the card's profile, so that a CPU test can check
pre-flight's prices against what the card did.

    python scripts/gpu_offload.py --device cuda --out gpu-check/offload.json

With `--device cpu` (the dry run) nothing can be offloaded (host and device are one memory):
only the pre-flight half runs, on a small model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers

from rematlab.core.files import write_text
from rematlab.core.recipe import Step
from rematlab.planning.planner import prepare
from rematlab.plans.offload import host_bytes
from rematlab.preflight.targets import profile_of_device
from rematlab.remat.layers import offloader_of
from rematlab.remat.strategies import apply

FRACTIONS = (0.25, 0.75)  # of the way from the floor (with offload) to keeping everything


def _model(layers: int, width: int) -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64))
    return transformers.GPT2LMHeadModel(config).train()


def _step_seconds(model: torch.nn.Module, batch: dict, step: Step, repeats: int = 5
                  ) -> float:
    """The median of `repeats` timed training steps, after one untimed."""
    optimizer = step.make_optimizer(model.parameters(), cuda=True)
    times = []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step.train_step(model, batch, optimizer=optimizer)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measured(device: str, layers: int, width: int, batch: int, seq: int) -> list[dict]:
    step = Step(precision="bf16", optimizer=torch.optim.AdamW)
    model = _model(layers, width).to(device)
    ids = torch.randint(0, 50257, (batch, seq), device=device)
    data = {"input_ids": ids, "labels": ids}
    planning = prepare(model, data, step=step, offload=True)
    plain = _step_seconds(model, data, step)
    rows = []
    floor = planning.floor_budget()
    for fraction in FRACTIONS:
        budget = int(floor + fraction * max(0, planning.full - floor))
        chosen = planning.choose(budget)
        planned = apply(model, chosen)
        seconds = _step_seconds(planned, data, step)
        offloader = offloader_of(planned)
        rows.append({"fraction": fraction, "budget": budget, "plan": chosen.describe(),
                     "predicted_peak": chosen.predicted_peak,
                     "measured_peak": chosen.measured_peak,
                     "predicted_time": chosen.predicted_time, "step_s": seconds,
                     "plain_step_s": plain,
                     "host_bytes": host_bytes(chosen.items, planning.costs),
                     "host_pinned": offloader.pool.allocated if offloader is not None else 0})
    return rows


def predicted(target: str, layers: int, width: int, batch: int, seq: int) -> dict:
    with torch.device("meta"):
        model = _model(layers, width)
    ids = torch.empty(batch, seq, dtype=torch.int64, device="meta")
    step = Step(precision="bf16", optimizer=torch.optim.AdamW)
    planning = prepare(model, {"input_ids": ids, "labels": ids}, predict=True, target=target,
                       step=step, offload=True)
    return {"target": target, "floor": planning.floor, "full": planning.full,
            "frontier": [{"plan": p.describe(), "peak": p.predicted_peak,
                          "time": p.predicted_time} for p in planning.solution.frontier]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    gpu = args.device != "cpu"
    shape = (6, 1024, 8, 1024) if gpu else (3, 256, 4, 512)
    facts: dict = {"model": dict(zip(("layers", "width", "batch", "seq"), shape, strict=True)),
                   "precision": "bf16", "optimizer": "AdamW"}
    target = "h100-80gb"
    if gpu:
        props = torch.cuda.get_device_properties(0)
        sheet = profile_of_device(props.name, props.total_memory)
        target = sheet.name if sheet is not None else target
        facts["device"] = props.name
        facts["measured"] = measured(args.device, *shape)
    facts["predicted"] = predicted(target, *shape)
    write_text(args.out, json.dumps(facts, indent=2))
    for row in facts.get("measured", []):
        print(f"budget {row['budget'] / 2**30:.2f} GiB: measured {row['measured_peak'] / 2**30:.2f}"
              f" GiB, {row['step_s'] * 1e3:.1f} ms against {row['plain_step_s'] * 1e3:.1f} ms "
              f"plain, {row['host_bytes'] / 2**20:.0f} MiB on the host: {row['plan']}")
    print(f"pre-flight for {target}: floor {facts['predicted']['floor'] / 2**20:.0f} MiB, "
          f"{len(facts['predicted']['frontier'])} plans")
    if any(r["measured_peak"] > r["budget"] for r in facts.get("measured", [])):
        raise SystemExit("an offload plan went over its budget")


if __name__ == "__main__":
    main()
