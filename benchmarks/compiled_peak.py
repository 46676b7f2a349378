"""One training-step measurement in a fresh process, for `benchmarks/planner.py`.

    python benchmarks/compiled_peak.py --model vgg16 --input cifar --batch 256 \
        [--compile --fraction 0.5]

CPU peak of compiled code: the dispatch tracker cannot see inside `torch.compile`d graphs, so
this reads the process high-water mark (VmHWM), reset through /proc/self/clear_refs after the
model, data and optimizer state exist and after warm-up (compilation) — the delta is what the
step allocates on top of the persistent tensors. For eager runs it also reports the tracker's
figure, so the two methods are cross-checked in the same process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from rematlab import zoo
from rematlab.measure import make_optimizer
from rematlab.probes import LiveTensorTracker


def _status(key: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="vgg16")
    parser.add_argument("--input", default="cifar")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--fraction", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, shape, _ = zoo.resolve(args.model, args.input)
    x = torch.randn(args.batch, *shape)
    y = torch.randint(0, 10, (args.batch,))
    opt = make_optimizer("momentum", model.parameters())
    if args.compile:
        torch._functorch.config.activation_memory_budget = args.fraction
        fn = torch.compile(model)
    else:
        fn = model

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(fn(x), y).backward()
        opt.step()

    for _ in range(3):  # warm-up: compilation and optimizer state
        step()
    persistent = sum(t.numel() * t.element_size() for t in [*model.parameters(), x, y]) + sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
        if isinstance(t, torch.Tensor))
    opt.zero_grad(set_to_none=True)
    deltas, times = [], []
    for _ in range(args.repeats):
        with open("/proc/self/clear_refs", "w", encoding="utf-8") as fh:
            fh.write("5")
        before = _status("VmRSS")
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
        deltas.append(_status("VmHWM") - before)
    out = {"model": args.model, "batch": args.batch, "compile": args.compile,
           "fraction": args.fraction, "persistent_bytes": persistent,
           "vmhwm_delta_bytes": int(statistics.median(deltas)),
           "vmhwm_peak_bytes": persistent + int(statistics.median(deltas)),
           "step_s": statistics.median(times)}
    if not args.compile:
        tracker = LiveTensorTracker()
        tracker.track([*model.parameters(), x, y, *(t for s in opt.state.values()
                                                    for t in s.values())])
        with tracker:
            step()
        out["tracker_peak_bytes"] = tracker.peak
    print(json.dumps(out))


if __name__ == "__main__":
    main()
