"""The README's first example, timed as a newcomer runs it: a fresh interpreter, imports
included (issue 52: "a first example that really runs in 30 s on a 2-core CPU").

    .venv/bin/python benchmarks/first_example.py [--runs 3] [--out docs/benchmarks/first-example.md]

The first ```python block of README.md is written to a file and run `--runs` times by
`sys.executable`, one after another; the wall times and their median are reported, with the
machine's load before each run (`os.getloadavg`), since a shared machine slows it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.publish import publish

ROOT = Path(__file__).resolve().parents[1]


def first_block() -> str:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("```python")
    return "\n".join(lines[start + 1:lines.index("```", start + 1)]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "first_example.py"
        script.write_text(first_block())
        rows = []
        for _ in range(args.runs):
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                                  cwd=tmp, timeout=600)
            rows.append((time.perf_counter() - t0, load, proc.returncode,
                         proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""))
    median = statistics.median(r[0] for r in rows)
    lines = ["# The README's first example", "",
             f"Produced by `python benchmarks/first_example.py --runs {args.runs}` "
             f"(module docstring), torch {torch.__version__}, {os.cpu_count()} cores.", "",
             "| run | wall time | load average before | exit | printed |", "|---|---|---|---|---|"]
    lines += [f"| {i + 1} | {t:.1f} s | {load:.2f} | {rc} | `{out}` |"
              for i, (t, load, rc, out) in enumerate(rows)]
    lines += ["", f"Median: **{median:.1f} s**, a fresh interpreter and its imports included."]
    publish("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
