"""Do two `rematlab measure` processes agree on the same configuration? Under glibc's
default host allocator, and under the one rematlab's own processes use (freed memory
retained, `rematlab.core.hostmem`).

    python benchmarks/repeatability.py [--quick] [--out docs/benchmarks/repeatability.md]

For each configuration, four processes run one after another, alternating the setting
(default, retained, default, retained), so both settings see the same machine; each process
is `rematlab measure --json` (its warm-up, its repeats under the interference guard, its
median step time). The disagreement of a setting is |first / second - 1| of its two
processes' medians. The whole sequence is repeated `--rounds` times; the table gives each
round's disagreement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.publish import publish
from rematlab.core import hostmem

CONFIGS = [
    ["--model", "vgg16", "--input", "cifar", "--batch", "32"],
    ["--model", "alexnet", "--input", "cifar", "--batch", "64"],
    ["--model", "lenet5", "--batch", "256"],
    ["--model", "mlp5", "--batch", "512"],
    ["--model", "vgg16", "--input", "cifar", "--batch", "32", "--strategy", "every:2"],
]
QUICK = CONFIGS[2:4]


def measure(args: list[str], setting: str, repeats: int) -> dict:
    """One `rematlab measure` process under `setting` ("retain" or "default")."""
    env = {**os.environ, hostmem.ENV: setting}
    done = subprocess.run([sys.executable, "-m", "rematlab.cli", "measure", *args,
                           "--repeats", str(repeats), "--json"],
                          capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path)
    opts = parser.parse_args()
    rows, started = [], time.perf_counter()
    for args in QUICK if opts.quick else CONFIGS:
        for round_ in range(opts.rounds):
            seen: dict[str, list[dict]] = {"default": [], "retain": []}
            for setting in ("default", "retain", "default", "retain"):
                seen[setting].append(measure(args, setting, opts.repeats))
            cells = []
            for setting in ("default", "retain"):
                a, b = (s["step_s_median"] for s in seen[setting])
                trusted = all(s.get("trusted", True) for s in seen[setting])
                cells.append(f"{a * 1e3:.1f} / {b * 1e3:.1f} ms: {abs(a / b - 1):.1%}"
                             + ("" if trusted else " (untrusted)"))
                assert {s["env"]["host_allocator"] for s in seen[setting]} == {
                    hostmem.RETAINED if setting == "retain" else hostmem.DEFAULT}
            rows.append(f"| `{' '.join(args)}` | {round_ + 1} | {cells[0]} | {cells[1]} |")
            print(rows[-1], flush=True)
    text = "\n".join([
        "# Repeatability across processes: the host allocator",
        "",
        f"`python benchmarks/repeatability.py{' --quick' if opts.quick else ''}`, "
        f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {os.cpu_count()} cores, "
        f"{opts.repeats} repeats per process, {time.perf_counter() - started:.0f} s in all.",
        "",
        __doc__.split("\n\n", 2)[2].strip(),
        "",
        "| configuration | round | glibc defaults: two processes' medians, disagreement "
        "| retained (rematlab's own processes) |",
        "|---|---|---|---|",
        *rows,
        "",
    ])
    publish(text, opts.out)


if __name__ == "__main__":
    main()
