"""Pre-flight plans checked on the device: each model planned without running
(`predict=True`) for the device here (`cuda`: calibrated on it; `cpu` in the dry run) and for
a data-sheet profile, then each plan's peak measured by the planner's own step measurement.
One step of `gpu_check.sh` (issue 28).

    python scripts/gpu_preflight.py --device cuda --profile h200 --out gpu-check/preflight.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rematlab.core.batch import to_device
from rematlab.core.files import write_text
from rematlab.measurement import zoo
from rematlab.planning.planner import prepare
from tests import realzoo

FRACTIONS = (0.0, 0.5, 1.0)


def _models(device: torch.device, small: bool) -> list[tuple[str, torch.nn.Module, object]]:
    gpt2, tokens = realzoo.gpt2(batch=4 if small else 16, seq=32 if small else 512,
                                layers=2 if small else 6, width=64 if small else 512)
    vgg, shape, _ = zoo.resolve("vgg16", "cifar")
    images = torch.randn(4 if small else 64, *shape)
    return [("gpt2", gpt2.to(device).train(), to_device(tokens, device)),
            ("vgg16", vgg.to(device).train(), images.to(device))]


def check(device: torch.device, targets: list[str], small: bool) -> list[dict]:
    rows = []
    for name, model, batch in _models(device, small):
        measured = prepare(model, batch)
        for target in targets:
            t0 = time.perf_counter()
            predicted = prepare(model, batch, predict=True, target=target)
            plan_s = time.perf_counter() - t0
            low, high = predicted.floor_budget(), int(predicted.full * 1.02)
            for fraction in FRACTIONS:
                budget = int(low + fraction * (high - low))
                chosen = predicted.choose(budget)
                peak = measured.measure(chosen)
                rows.append({"model": name, "target": target, "fraction": fraction,
                             "budget": budget, "plan": chosen.describe(),
                             "predicted_peak": chosen.predicted_peak, "measured_peak": peak,
                             "error": (chosen.predicted_peak - peak) / peak,
                             "within_budget": peak <= budget, "preflight_s": plan_s})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", default=None, help="a data-sheet target to check too")
    parser.add_argument("--small", action="store_true", help="smallest sizes (dry run)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    targets = [device.type, *([args.profile] if args.profile else [])]
    rows = check(device, targets, args.small)
    write_text(args.out, json.dumps(rows, indent=2))
    for r in rows:
        print(f"pre-flight {r['model']} for {r['target']} at {r['fraction']:.0%}: predicted "
              f"{r['predicted_peak'] / 2**20:.1f} MiB, measured {r['measured_peak'] / 2**20:.1f}"
              f" MiB ({r['error']:+.2%}){'' if r['within_budget'] else ' OVER BUDGET'}")


if __name__ == "__main__":
    main()
