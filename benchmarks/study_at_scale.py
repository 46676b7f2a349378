"""The record of the study at the original study's scale (grids/seed-study-cpu.toml).

Reads the sweep's database (run it first, resumably, as many sittings as it takes) and
writes docs/study-at-scale.md: the sweep's wall time over its sittings and its harness
overhead, the outcomes and what the interference guard saw, `rematlab fit`'s wall time and
evaluation next to the original study's R², the claims check and the guidelines.

    .venv/bin/rematlab sweep grids/seed-study-cpu.toml --db results/seed-study-cpu.duckdb
    .venv/bin/python benchmarks/study_at_scale.py --db results/seed-study-cpu.duckdb \\
        [--out docs/study-at-scale.md]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import pandas as pd

from rematlab.study.grid import load_grid
from rematlab.study.predictor import fit_and_evaluate
from rematlab.study.report import STUDY_R2
from rematlab.study.reproduce import grid_caps
from rematlab.study.stats import analyze
from rematlab.study.store import config_id, harness_overhead, load, remeasured, trusted_only
from rematlab.study.tables import markdown_table, percent_columns


def sweep_section(db: Path, grid: str) -> list[str]:
    sweeps = load(db, "sweeps")
    summary = load(db, "config_summary")
    specs = load_grid(grid).expand()
    covered = set(summary.loc[summary["outcome"].isin(["ok", "oom"]), "config_id"])
    missing = sum(config_id(s.to_dict()) not in covered for s in specs)
    wall, measured = float(sweeps["wall_s"].sum()), float(sweeps["measured_s"].sum())
    ok = summary[summary["outcome"] == "ok"]
    outcomes = summary["outcome"].value_counts().to_dict()
    sittings = percent_columns(sweeps[["started_at", "wall_s", "measured_s",
                                       "harness_overhead", "configs", "status"]].round(1),
                               ["harness_overhead"])
    return [
        "## The sweep", "",
        f"{len(specs)} configurations in the grid; {len(specs) - missing} stored with a "
        f"result (ok or oom), {missing} missing. Outcomes: "
        + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())) + ".", "",
        f"Wall time {wall / 3600:.2f} h over {len(sweeps)} sitting(s), of which "
        f"{measured / 3600:.2f} h inside measured steps: harness overhead "
        f"{harness_overhead(measured, wall):.1%}.", "",
        markdown_table(sittings), "",
        "The interference guard: "
        f"{remeasured(summary)} repeats measured again, "
        f"{trusted_only(summary)[1]} configurations not trusted (left out of the analyses "
        f"below), median foreign load {ok['foreign_load'].median():.1%}, median repeat "
        f"spread (IQR / median) {ok['step_spread'].median():.1%}.", ""]


def predictor_section(summary: pd.DataFrame) -> list[str]:
    start = time.perf_counter()
    predictor, table, data = fit_and_evaluate(summary)
    took = time.perf_counter() - start
    table = table.assign(**{"study R²": [STUDY_R2[t] if p == "random 80/20" else None
                                         for t, p in zip(table["target"], table["protocol"],
                                                         strict=True)]})
    return [
        "## Predictors", "",
        f"`rematlab fit` (features, evaluation of every model under every protocol, the "
        f"chosen predictor's fit) took {took:.1f} s on {os.cpu_count()} cores for "
        f"{len(data)} configurations. Chosen: time {predictor.names_['time']}, memory "
        f"{predictor.names_['memory']}. The original study's R² (random 80/20) stands "
        "beside ours.", "", markdown_table(percent_columns(table, ["mape", "p90_ape"])), ""]


def stats_section(summary: pd.DataFrame, runs: pd.DataFrame) -> list[str]:
    report = analyze(summary, runs, memory_cap=grid_caps(summary))
    return ["## Claims check", "", *[f"- {n}" for n in report.notes], "",
            markdown_table(report.claims), "", "## Guidelines", "",
            markdown_table(percent_columns(report.guidelines,
                                           ["memory saving", "time overhead"])), ""]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", type=Path, default=Path("results/seed-study-cpu.duckdb"))
    parser.add_argument("--grid", default="grids/seed-study-cpu.toml")
    parser.add_argument("--out", type=Path, default=Path("docs/study-at-scale.md"))
    args = parser.parse_args()
    summary, runs = load(args.db, "config_summary"), load(args.db)
    lines = ["# The study at the original study's scale", "",
             f"Command: `python {' '.join(sys.argv)}` after `rematlab sweep {args.grid} "
             f"--db {args.db}`. Device: {summary['device_name'].dropna().iloc[0]}, "
             f"{int(runs['threads'].dropna().iloc[0])} threads.", "",
             *sweep_section(args.db, args.grid), *predictor_section(summary),
             *stats_section(summary, runs)]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
