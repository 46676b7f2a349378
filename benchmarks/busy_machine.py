"""The quick study's measurements on a busy machine, against the same on a quiet one.

A CPU-burning process runs beside the sweep — another job on a shared machine: it burns one
core in spells of 2-10 s with pauses of 2-10 s (`--persistent`: without pauses). Both
databases then go through the study's analyses; the record compares what the interference
guard saw (repeats measured again, configurations left out), the claim verdicts, and the
predictors' time MAPE, with and without the untrusted configurations.

    .venv/bin/rematlab study --grid quick --db results/quick.duckdb ...   # the quiet run
    .venv/bin/python benchmarks/busy_machine.py --quiet results/quick.duckdb \\
        --busy results/quick-busy.duckdb [--out docs/benchmarks/busy-machine.md]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import sys
import time
from pathlib import Path

import pandas as pd

from rematlab.study.grid import load_grid
from rematlab.study.predictor import fit_and_evaluate
from rematlab.study.reproduce import grid_caps
from rematlab.study.stats import analyze
from rematlab.study.store import harness_overhead, load, remeasured, trusted_only
from rematlab.study.sweep import SweepResult, sweep
from rematlab.study.tables import markdown_table


def burn(stop: mp.synchronize.Event, persistent: bool, seed: int = 0) -> None:
    """Burn one core, in spells (or without pause), until `stop` is set."""
    rng = random.Random(seed)
    while not stop.is_set():
        end = time.monotonic() + (3600.0 if persistent else rng.uniform(2.0, 10.0))
        while time.monotonic() < end and not stop.is_set():
            sum(i * i for i in range(10_000))
        if not persistent:
            stop.wait(rng.uniform(2.0, 10.0))


def busy_sweep(grid: str, db: Path, persistent: bool) -> SweepResult:
    """The grid swept into `db` (resumed if there) with the burner running throughout,
    the sweep's second attempts at untrusted configurations included."""
    stop = mp.Event()
    burner = mp.Process(target=burn, args=(stop, persistent), daemon=True)
    burner.start()
    try:
        return sweep(load_grid(grid), db, progress=lambda s, o, d, t: print(
            f"[{d}/{t}] {o} {s.model} b{s.batch} {s.strategy}", flush=True))
    finally:
        stop.set()
        burner.join()


def outcome(db: Path, untrusted: bool) -> dict:
    summary, runs = load(db, "config_summary"), load(db)
    sweeps = load(db, "sweeps")
    stats = analyze(summary, runs, memory_cap=grid_caps(summary), untrusted=untrusted)
    _, table, data = fit_and_evaluate(summary, untrusted=untrusted)
    time_rows = table[(table["target"] == "time") & (table["protocol"] == "random 80/20")]
    best = time_rows.loc[time_rows["mape"].idxmin()]
    ok = summary[summary["outcome"] == "ok"]
    return {"verdicts": stats.claims.set_index("claim")["verdict"],
            "configurations": len(summary), "ok": len(ok),
            "left out": trusted_only(summary)[1] if not untrusted else 0,
            "re-measured repeats": remeasured(summary),
            "wall (s)": float(sweeps["wall_s"].sum()),
            "harness overhead": harness_overhead(float(sweeps["measured_s"].sum()),
                                                 float(sweeps["wall_s"].sum())),
            "time MAPE (best, random 80/20)": f"{best['mape']:.2%} ({best['model']})",
            "fitted on": len(data)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quiet", type=Path, default=Path("results/quick.duckdb"))
    parser.add_argument("--busy", type=Path, default=Path("results/quick-busy.duckdb"))
    parser.add_argument("--grid", default="quick")
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/busy-machine.md"))
    args = parser.parse_args()
    result = busy_sweep(args.grid, args.busy, args.persistent)  # resumes when already there
    runs = {"quiet": outcome(args.quiet, False), "busy": outcome(args.busy, False),
            "busy, untrusted kept": outcome(args.busy, True)}
    facts = pd.DataFrame({k: {f: v for f, v in r.items() if f != "verdicts"}
                          for k, r in runs.items()})
    second = f"{result.remeasured} ({result.settled} trusted)"
    facts.loc["second attempts, this sitting (trusted)"] = ["", second, second]
    verdicts = pd.DataFrame({k: r["verdicts"] for k, r in runs.items()})
    same = (verdicts["quiet"] == verdicts["busy"]).sum()
    burner = "without pause" if args.persistent else "in spells of 2-10 s with 2-10 s pauses"
    text = "\n".join([
        "# The quick study on a busy machine", "",
        f"Command: `python {' '.join(sys.argv)}`. Beside the busy sweep a process burned "
        f"one of the machine's cores {burner}; the quiet run is the study's own database.", "",
        markdown_table(facts, index=True), "",
        f"Claim verdicts: {same} of {len(verdicts)} the same on the busy machine as on the "
        "quiet one (with the guard's untrusted configurations left out, as analyses do by "
        "default).", "", markdown_table(verdicts, index=True), ""])
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
