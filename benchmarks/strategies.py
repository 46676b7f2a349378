"""Every strategy side by side, as ratios to `none` measured in the same run.

    .venv/bin/python benchmarks/strategies.py [--repeats 5] [--out docs/benchmarks/strategies.md]

VGG-16 (CIFAR, batch 128) and MLP-7 (batch 2048), momentum SGD, float32, on this machine's CPU.
"""

from __future__ import annotations

import argparse
import platform
import sys

import torch

from rematlab import Spec
from rematlab.core.units import format_bytes
from rematlab.measurement.measure import measure

CASES = [("vgg16", "cifar", 128), ("mlp7", "mnist", 2048)]
STRATEGIES = ["none", "uniform:2", "uniform:4", "every:1", "every:2", "sqrt", "selective"]


def run(repeats: int) -> str:
    lines = [f"Command: `{' '.join([sys.executable.split('/')[-1], *sys.argv])}`  ",
             f"Machine: {platform.processor() or platform.machine()}, "
             f"{torch.get_num_threads()} threads, torch {torch.__version__}, {repeats} repeats "
             "(median; IQR/median in brackets)", ""]
    for model, scale, batch in CASES:
        obs = {s: measure(Spec(model=model, input=scale, batch=batch, strategy=s,
                               repeats=repeats)) for s in STRATEGIES}
        base = obs["none"]
        lines += [f"### {model} ({scale}, batch {batch})", "",
                  "| strategy | peak | peak / none | saved activations | saved / none | "
                  "FLOPs / none | recompute FLOPs | step time | time / none |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for s, o in obs.items():
            f = o.figures
            flops = f["forward_flops"] + f["backward_flops"]
            base_flops = base.figures["forward_flops"] + base.figures["backward_flops"]
            lines.append(
                f"| {s} | {format_bytes(o.peak)} | {o.peak / base.peak:.3f} | "
                f"{format_bytes(f['saved_activation_bytes'])} | "
                f"{f['saved_activation_bytes'] / base.figures['saved_activation_bytes']:.3f} | "
                f"{flops / base_flops:.3f} | {f['recompute_flops'] / 1e9:.2f} GFLOP | "
                f"{o.median() * 1e3:.1f} ms ({o.iqr() / o.median():.0%}) | "
                f"{o.median() / base.median():.3f} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="docs/benchmarks/strategies.md")
    args = parser.parse_args()
    text = run(args.repeats)
    with open(args.out, "w", encoding="utf-8") as fh:
        fh.write("# Strategies side by side\n\n" + text + "\n")
    print(text)
