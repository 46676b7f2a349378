"""Pre-flight plans checked on the device: five models (GPT-2, BERT and Llama configs, VGG-16,
a ResNet) in the user's bf16 autocast step with AdamW, each planned without running
(`predict=True`) for the device here (`cuda`: calibrated on it; `cpu` in the dry run) and for
a data-sheet profile, at three budgets from the predicted floor to unconstrained; then each
plan's step peak measured by the planner's own measurement, with the caching allocator's
allocated and reserved peaks, and the CUDA context (what the process holds on the card beyond
the allocator's reserve). One step of `gpu_check.sh` (issues 28 and 40); the markdown report
is `docs/gpu.md` on a GPU.

    python scripts/gpu_preflight.py --device cuda --profile h200 --out gpu-check/preflight.json \\
        --doc docs/gpu.md
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
from rematlab.core.recipe import Step
from rematlab.measurement import zoo
from rematlab.planning.planner import prepare
from tests import realzoo

FRACTIONS = (0.0, 0.5, 1.0)
MiB = 2 ** 20


def _models(small: bool) -> list[tuple[str, torch.nn.Module, object]]:
    """(name, model, batch): transformers' configs at widths of 1-4k on a GPU (64 in the dry
    run), VGG-16 and a ResNet."""
    seq, batch = (32, 4) if small else (512, 8)
    gpt2 = realzoo.gpt2(batch=batch, seq=seq, layers=2 if small else 6,
                        width=64 if small else 1024)
    bert = realzoo.bert(batch=batch, seq=seq, layers=2 if small else 6,
                        width=64 if small else 2048)
    llama = realzoo.llama(batch=batch, seq=seq, layers=2 if small else 4,
                          width=64 if small else 4096)
    vgg, shape, _ = zoo.resolve("vgg16", "cifar")
    resnet = realzoo.resnet(batch=8 if small else 64, size=16 if small else 64)
    return [("gpt2", *gpt2), ("bert", *bert), ("llama", *llama),
            ("vgg16", vgg, torch.randn(4 if small else 64, *shape)), ("resnet", *resnet)]


def _peaks(planning, chosen, device: torch.device) -> tuple[int, int | None]:
    """`chosen`'s measured step peak, and the allocator's reserved peak meanwhile (CUDA)."""
    if device.type != "cuda":
        return planning.measure(chosen), None
    torch.cuda.reset_peak_memory_stats(device)
    peak = planning.measure(chosen)
    return peak, torch.cuda.max_memory_reserved(device)


def cuda_context(device: torch.device) -> int | None:
    """Bytes this process holds on the card beyond the caching allocator's reserve: the CUDA
    context and the libraries' modules (alone on the card, after a training step)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def check(device: torch.device, targets: list[str], small: bool) -> list[dict]:
    step = Step(precision="bf16", optimizer=torch.optim.AdamW)
    rows = []
    for name, model, batch in _models(small):
        model, batch = model.to(device).train(), to_device(batch, device)
        measured = prepare(model, batch, step=step)
        for target in targets:
            t0 = time.perf_counter()
            predicted = prepare(model, batch, predict=True, target=target, step=step)
            plan_s = time.perf_counter() - t0
            top = predicted.full  # the unconstrained plan, reserved on a card (above it)
            if predicted.target.kind == "cuda":
                top = max(top, predicted.card(predicted.unconstrained).reserved)
            low = predicted.floor_budget()
            high = max(low, int(top * 1.02))
            for fraction in FRACTIONS:
                budget = int(low + fraction * (high - low))
                chosen = predicted.choose(budget)
                peak, reserved = _peaks(measured, chosen, device)
                card = predicted.card(chosen) if predicted.target.kind == "cuda" else None
                rows.append({"model": name, "target": target, "fraction": fraction,
                             "budget": budget, "plan": chosen.describe(),
                             "predicted_peak": chosen.predicted_peak, "measured_peak": peak,
                             "predicted_reserved": card.reserved if card else None,
                             "reserved_peak": reserved,
                             "error": (chosen.predicted_peak - peak) / peak,
                             "within_budget": peak <= budget, "preflight_s": plan_s})
    return rows


def report(rows: list[dict], context: int | None, device: str) -> str:
    """The markdown report: predicted against measured, per model, target and budget."""
    lines = ["# Pre-flight on a GPU: predicted against measured", "",
             f"`scripts/gpu_check.sh` on {device}, torch {torch.__version__}; bf16 autocast, "
             "AdamW. Measured: the planner's own step measurement (`max_memory_allocated`), "
             "and the caching allocator's reserved peak.", "",
             "CUDA context (the process's bytes on the card beyond the allocator's reserve): "
             + (f"{context / MiB:.0f} MiB measured (pre-flight assumes 512 MiB)." if context
                is not None else "not measured (no GPU)."), "",
             "| model | target | budget | plan | predicted allocated | measured allocated | "
             "predicted reserved | measured reserved | error | fits |", "|---" * 10 + "|"]

    def mib(n: int | None) -> str:
        return f"{n / MiB:.1f} MiB" if n else "-"
    for r in rows:
        lines.append(f"| {r['model']} | {r['target']} | {mib(r['budget'])} | {r['plan']} | "
                     f"{mib(r['predicted_peak'])} | {mib(r['measured_peak'])} | "
                     f"{mib(r['predicted_reserved'])} | {mib(r['reserved_peak'])} | "
                     f"{r['error']:+.2%} | {'yes' if r['within_budget'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", default=None, help="a data-sheet target to check too")
    parser.add_argument("--small", action="store_true", help="smallest sizes (dry run)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--doc", default=None, help="write the markdown report here")
    args = parser.parse_args()
    device = torch.device(args.device)
    targets = [device.type, *([args.profile] if args.profile else [])]
    rows = check(device, targets, args.small)
    context = cuda_context(device)
    write_text(args.out, json.dumps({"rows": rows, "cuda_context": context}, indent=2))
    if args.doc:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
        write_text(args.doc, report(rows, context, name))
    for r in rows:
        print(f"pre-flight {r['model']} for {r['target']} at {r['fraction']:.0%}: predicted "
              f"{r['predicted_peak'] / MiB:.1f} MiB, measured {r['measured_peak'] / MiB:.1f}"
              f" MiB ({r['error']:+.2%}){'' if r['within_budget'] else ' OVER BUDGET'}")


if __name__ == "__main__":
    main()
