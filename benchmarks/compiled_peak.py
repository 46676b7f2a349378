"""One training-step measurement in a fresh process, for `benchmarks/planner.py`.

    python benchmarks/compiled_peak.py --model vgg16 --input cifar --batch 256 \
        [--compile [--fraction 0.5]] [--plan plan.json]

Runs eager or `torch.compile`d training steps — the model plainly, or a rematlab plan applied
to it (`--plan`; compiled, the plan's segments become recompute regions of the graph) — and
prints one JSON line: the median and the fastest step time (the benchmark compares the fastest:
interference here only slows steps) and the step's peak memory by two methods:

- allocator: `CpuAllocatorTrace` (the c10 allocator's own events, which see inside compiled
  code and kernel workspaces) on top of the persistent tensors — the figure of record;
- VmHWM: the process high-water mark, reset through /proc/self/clear_refs before the step,
  minus the RSS before it, on top of the persistent tensors — a cross-check that also sees
  allocator caching and the interpreter, so it is noisier.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from rematlab.core.optimizers import make_optimizer
from rematlab.core.probes import CpuAllocatorTrace
from rematlab.core.timer import Timer, timed
from rematlab.measurement import zoo
from rematlab.plans.plan import Plan
from rematlab.remat.strategies import RematChain


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
    parser.add_argument("--plan", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, shape, _ = zoo.resolve(args.model, args.input)
    x = torch.randn(args.batch, *shape)
    y = torch.randint(0, 10, (args.batch,))
    opt = make_optimizer("momentum", model.parameters())
    net = model
    if args.plan:
        with open(args.plan, encoding="utf-8") as fh:
            net = RematChain(list(model), Plan.from_json(fh.read()))
    if args.compile:
        torch._functorch.config.activation_memory_budget = args.fraction
    fn = torch.compile(net) if args.compile else net

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
    timing = Timer(torch.device("cpu")).run(timed(step), args.repeats, warmup=0)
    times = timing.seconds()
    hwm, allocator = [], []
    for _ in range(args.repeats):
        opt.zero_grad(set_to_none=True)
        with open("/proc/self/clear_refs", "w", encoding="utf-8") as fh:
            fh.write("5")
        before = _status("VmRSS")
        step()
        opt.zero_grad(set_to_none=True)
        hwm.append(_status("VmHWM") - before)
        with CpuAllocatorTrace() as trace:
            step()
        opt.zero_grad(set_to_none=True)
        allocator.append(trace.peak)
    print(json.dumps({
        "model": args.model, "batch": args.batch, "compile": args.compile,
        "fraction": args.fraction if args.compile else None, "plan": args.plan,
        "persistent_bytes": persistent,
        "allocator_peak_bytes": persistent + max(allocator),
        "allocator_spread_bytes": max(allocator) - min(allocator),
        "vmhwm_peak_bytes": persistent + int(statistics.median(hwm)),
        "step_s": statistics.median(times),
        "step_min_s": min(times),
        "step_iqr_s": timing.iqr(),
        "timing": "rematlab.core.timer: interleaved repeats under the interference guard",
        **timing.evidence.columns(),
    }))


if __name__ == "__main__":
    main()
