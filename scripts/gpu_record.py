"""Record GPU facts (issue 49): one fact file (`tests/gpufacts.py`'s format) that the CPU
tests replay (`tests/test_gpu_facts.py`). Each model is measured in a process of its own
(nothing else of ours on the card), capped in time; a model that fails or runs out of time is
recorded as such and the others still run.

Per model, in the user's bf16 autocast step with AdamW: three plans predicted for the card's
data-sheet profile (floor, midway, unconstrained), each run and its allocated and reserved
peaks measured (the allocator's cache emptied and its peaks reset first); per layer, the ops
dispatched and the bytes saved, in fp32 and under autocast; GPT-2's first layer's op-level
menu measured on the card (`gpufacts.option_facts`); the CUDA context. `--dry-run`
records on this CPU at the smallest sizes, in the same format (what CI runs).

    python scripts/gpu_record.py --out gpu-check/facts            # on a GPU, ~2 minutes
    python scripts/gpu_record.py --dry-run --out /tmp/facts       # on the CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import contextlib

from rematlab.core.batch import to_device
from rematlab.core.files import write_text
from rematlab.core.recipe import Step
from rematlab.planning.planner import prepare
from rematlab.preflight.targets import profile_of_device
from tests import gpufacts

FRACTIONS = (0.0, 0.5, 1.0)


def _peaks(planning, plan, device: torch.device) -> tuple[int, int]:
    """`plan`'s measured step peak and the allocator's reserved peak meanwhile (the process
    holds nothing but this model's step: one model per process)."""
    if device.type != "cuda":
        peak = planning.measure(plan)
        return peak, peak
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    peak = planning.measure(plan)
    return peak, torch.cuda.max_memory_reserved(device)


def record_model(name: str, kwargs: dict, device: torch.device, profile: str) -> dict:
    """The facts of one model (module docstring)."""
    model, batch = gpufacts.build(name, kwargs)
    model, batch = model.to(device), to_device(batch, device)
    step = gpufacts.step()
    measured = prepare(model, batch, step=step)
    predicted = prepare(model, batch, predict=True, target=profile, step=step)
    low = predicted.floor_budget()
    top = max(low, predicted.full)
    if predicted.target.kind == "cuda":
        top = max(top, predicted.card(predicted.unconstrained).reserved)
    plans, rows = {}, []
    for fraction in FRACTIONS:
        plan = predicted.choose(int(low + fraction * (1.02 * top - low)))
        plans.setdefault(plan.describe(), plan)
    for text, plan in plans.items():
        allocated, reserved = _peaks(measured, plan, device)
        rows.append({"model": name, "plan": text, "allocated": allocated, "reserved": reserved})
    layers = {}
    if measured.structure.kind == "layers":  # a chain's blocks run outside the model's forward
        for precision in ("fp32", "bf16"):
            layers[precision] = gpufacts.layer_facts(
                model, batch, Step(precision=precision), device.type)
    options = None
    if name in gpufacts.OPTION_MODELS:  # the op-level menu, measured under the step
        options = gpufacts.option_facts(prepare(model, batch, step=step, ops=True))
    context = None
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        context = total - free - torch.cuda.memory_reserved(device)
    return {"plans": rows, "layers": layers, "options": options, "context": context}


def card(device: torch.device) -> dict:
    """The card (or, in a dry run, this CPU) the facts are of."""
    if device.type != "cuda":
        return {"name": "cpu", "profile": "cpu", "capability": None, "total_memory": None,
                "driver": None, "cuda": None}
    props = torch.cuda.get_device_properties(device)
    sheet = profile_of_device(props.name, props.total_memory)
    driver = None
    with contextlib.suppress(OSError, IndexError, subprocess.SubprocessError):
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                 "--format=csv,noheader"], capture_output=True, text=True,
                                timeout=10).stdout.strip().splitlines()[0]
    return {"name": props.name, "profile": sheet.name if sheet else None,
            "capability": [props.major, props.minor], "total_memory": props.total_memory,
            "driver": driver, "cuda": torch.version.cuda or torch.version.hip}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the folder facts.json is written to")
    parser.add_argument("--dry-run", action="store_true", help="this CPU, smallest sizes")
    parser.add_argument("--models", default=",".join(gpufacts.MODELS))
    parser.add_argument("--limit", type=float, default=60.0, help="seconds per model")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child's model
    args = parser.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    sizes = gpufacts.SMALL if args.dry_run else gpufacts.SIZES
    about = card(device)
    profile = about["profile"] or "h100-80gb"
    if args.one:  # the child: one model, its facts on stdout
        print(json.dumps(record_model(args.one, sizes[args.one], device, profile)))
        return
    import transformers

    facts = {"format": gpufacts.FORMAT, "card": about, "torch": torch.__version__,
             "transformers": transformers.__version__, "python": sys.version.split()[0],
             "recorded": datetime.date.today().isoformat(),
             "how": "scripts/gpu_record.py" + (" --dry-run" if args.dry_run else ""),
             "step": {"precision": "bf16", "optimizer": "AdamW"},
             "context": {}, "models": {}, "plans": [], "layers": {}, "options": {},
             "failed": {}}
    for name in args.models.split(","):
        t0 = time.perf_counter()
        cmd = [sys.executable, __file__, "--out", args.out, "--one", name,
               *(["--dry-run"] if args.dry_run else [])]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.limit)
            if done.returncode != 0:
                raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr
                                   else f"exit {done.returncode}")
            one = json.loads(done.stdout.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, RuntimeError, ValueError, IndexError) as exc:
            facts["failed"][name] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"{name}: FAILED ({facts['failed'][name]})", flush=True)
            continue
        facts["models"][name] = sizes[name]
        facts["plans"] += one["plans"]
        if one["layers"]:
            facts["layers"][name] = one["layers"]
        if one["options"]:
            facts["options"][name] = one["options"]
        if one["context"] is not None:
            facts["context"][name] = one["context"]
        print(f"{name}: {len(one['plans'])} plans in {time.perf_counter() - t0:.0f} s",
              flush=True)
    write_text(Path(args.out) / "facts.json", json.dumps(facts, indent=1) + "\n")


if __name__ == "__main__":
    main()
