"""Plans at three budgets between a model's floor and its unconstrained peak, eager and for
`torch.compile`, each with its simulated and measured peak: one step of `gpu_check.sh`.

    python scripts/gpu_plans.py --model vgg16 --input imagenet --batch 64 --device cuda \
        --out gpu-check/plans.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from rematlab.core.files import write_text
from rematlab.measurement import zoo
from rematlab.planning.planner import prepare

FRACTIONS = (0.0, 0.5, 0.9)


def plans(model_name: str, scale: str | None, batch: int, device: str, compile: bool
          ) -> list[dict]:
    model, shape, _ = zoo.resolve(model_name, scale)
    dev = torch.device(device)
    model = model.to(dev).train()
    x = torch.randn(batch, *shape, device=dev)
    t0 = time.perf_counter()
    planning = prepare(model, x, compile=compile)
    prepare_s = time.perf_counter() - t0
    rows = []
    floor = planning.floor_budget()
    for fraction in FRACTIONS:
        budget = int(floor + fraction * max(0, planning.full - floor))
        t1 = time.perf_counter()
        chosen = planning.choose(budget)
        predicted = chosen.predicted_peak  # None: a torch.compile fraction, measured only
        rows.append({
            "model": model_name, "input": scale, "batch": batch, "device": device,
            "compiled": compile, "fraction": fraction, "budget": budget,
            "floor": floor, "unconstrained": planning.full, "plan": chosen.describe(),
            "predicted_peak": chosen.predicted_peak, "measured_peak": chosen.measured_peak,
            "error": (None if predicted is None
                      else (predicted - chosen.measured_peak) / chosen.measured_peak),
            "within_budget": chosen.measured_peak <= budget, "prepare_s": prepare_s,
            "choose_s": time.perf_counter() - t1})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg16")
    parser.add_argument("--input", default=None)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile-model", default=None,
                        help="model for the --compile plans (default: --model)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = plans(args.model, args.input, args.batch, args.device, compile=False)
    rows += plans(args.compile_model or args.model, args.input if not args.compile_model
                  else None, args.batch, args.device, compile=True)
    write_text(args.out, json.dumps(rows, indent=2))
    for r in rows:
        predicted = ("measured only (a torch.compile fraction)" if r["error"] is None else
                     f"predicted {r['predicted_peak'] / 2**20:.1f} MiB ({r['error']:+.2%})")
        print(f"{r['model']} compiled={r['compiled']} budget {r['budget'] / 2**20:.1f} MiB: "
              f"measured {r['measured_peak'] / 2**20:.1f} MiB, {predicted}, {r['plan']}")
    if not all(r["within_budget"] for r in rows):
        raise SystemExit("a plan went over its budget")


if __name__ == "__main__":
    main()
