"""Commands on datasets: `sweep` a grid, `export`, `stats`, `fit` and `predict`, the
`gradients` comparison, and the whole `study`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from rematlab.cli.app import (
    IncludeUntrusted,
    _print_json,
    _shape,
    app,
    console,
    handles_errors,
)
from rematlab.core.files import jsonable, refuse_overwriting_inputs, write_bytes, write_text
from rematlab.core.units import format_bytes, format_number, parse_bytes
from rematlab.exceptions import ConfigError


@app.command("sweep")
@handles_errors
def sweep_cmd(
    grid: Annotated[str, typer.Argument(help="grid file, or quick / seed-study")],
    db: Annotated[Path, typer.Option(help="results database (DuckDB)")] = Path("results.duckdb"),
    backend: Annotated[str, typer.Option(help="local or ray")] = "local",
    ray_address: Annotated[str | None, typer.Option(help="existing Ray cluster")] = None,
    dry_run: Annotated[bool, typer.Option(help="print the expansion, run nothing")] = False,
    max_wait: Annotated[float | None, typer.Option(
        help="seconds one configuration may wait for a quiet machine (grid: max_wait_s)")]
    = None,
    max_wait_total: Annotated[float | None, typer.Option(
        help="seconds the whole sweep may wait for quiet (grid: max_wait_total_s)")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Run a grid of configurations into the dataset (resumable)."""
    from rematlab.measurement.hardware import estimate_seconds
    from rematlab.study.grid import load_grid
    from rematlab.study.sweep import resume_hint

    spec_grid = load_grid(grid, max_wait_s=max_wait, max_wait_total_s=max_wait_total)
    if dry_run:
        specs = spec_grid.expand()
        seconds = estimate_seconds(specs)
        if as_json:
            _print_json({"configurations": len(specs), "estimated_seconds": seconds})
        else:
            console.print(f"{len(specs)} configurations")
            console.print(f"estimated duration: {seconds / 60:.1f} min (rough, from FLOPs)")
        return
    result = run_sweep(spec_grid, db, backend, ray_address, grid)
    if as_json:
        _print_json({"total": result.total, "skipped": result.skipped,
                     "outcomes": dict(result.outcomes), "wall_s": result.wall_s,
                     "measured_s": result.measured_s,
                     "harness_overhead": result.harness_overhead,
                     "untrusted": result.untrusted, "remeasured": result.remeasured,
                     "remeasured_trusted": result.settled,
                     "waited_s": result.waited_s, "wait_bound_reached": result.wait_spent,
                     "interrupted": result.interrupted, "retried_errors": result.retried,
                     "stale_sweeps_marked_interrupted": result.stale})
    else:
        table = Table(title=f"sweep {spec_grid.name} -> {db}")
        for col in ("configurations", "skipped (done before)", "ok", "untrusted", "oom",
                    "error", "wall", "harness overhead"):
            table.add_column(col, justify="right")
        table.add_row(str(result.total), str(result.skipped), str(result.outcomes["ok"]),
                      str(result.untrusted), str(result.outcomes["oom"]),
                      str(result.outcomes["error"]), f"{result.wall_s:.1f} s",
                      f"{result.harness_overhead:.1%}")
        if result.remeasured:
            console.print(f"{result.remeasured} configuration(s) timed while the machine was "
                          f"busy were measured again once it was quiet: {result.settled} "
                          "trusted the second time")
        if result.waited_s:
            console.print(f"waited {result.waited_s:.1f} s for a quiet machine (bounds: "
                          f"{spec_grid.max_wait_s:g} s a configuration, "
                          f"{spec_grid.max_wait_total_s:g} s the sweep"
                          + ("; reached: the rest ran without waiting" if result.wait_spent
                             else "") + ")")
        if result.untrusted:
            console.print(f"{result.untrusted} configuration(s) timed while other processes "
                          "loaded the machine (the guard's evidence is in each row): "
                          "analyses leave them out; running the sweep again re-measures "
                          "them")
        console.print(table)
        if result.retried or result.stale:
            console.print(f"retried {result.retried} configuration(s) stored as error; "
                          f"marked {result.stale} stale sweep(s) as interrupted")
    if result.interrupted:
        sys.stderr.write(f"interrupted: {result.skipped + len(result)} of {result.total} "
                         f"configurations are stored; resume with: "
                         f"{resume_hint(grid, db, backend)}\n")
        raise typer.Exit(130)


def run_sweep(spec_grid, db: Path, backend: str, ray_address: str | None, label: str):
    """A sweep with a progress bar (counts of ok / oom / error, ETA) on stderr."""
    from collections import Counter

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from rematlab.study.sweep import sweep

    counts: Counter = Counter()
    stderr = Console(stderr=True)

    def tally(outcome: str) -> None:
        """Count a result: untrusted ones are ok results timed on a busy machine; second
        attempts (`re-measured, trusted`, `still untrusted`) change no count."""
        if outcome.startswith("untrusted"):
            counts["ok"] += 1
            counts["untrusted"] += 1
        elif outcome in ("ok", "oom", "error"):
            counts[outcome] += 1

    def tallied() -> str:
        busy = (f" ({counts['untrusted']} untrusted: busy machine)" if counts["untrusted"]
                else "")
        return f"ok {counts['ok']}{busy}, oom {counts['oom']}, error {counts['error']}"
    if not stderr.is_terminal:  # logs on a cluster: one line per configuration
        def log(spec, outcome: str, done: int, total: int) -> None:
            tally(outcome)
            sys.stderr.write(f"[{done}/{total}] {outcome} {spec.model} b{spec.batch} "
                             f"{spec.strategy} {spec.device} ({tallied()})\n")
            sys.stderr.flush()

        return sweep(spec_grid, db, backend=backend, ray_address=ray_address, progress=log,
                     grid_label=label)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[counts]}"), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=stderr) as bar:
        task = bar.add_task("sweep", total=None, counts="")

        def progress(spec, outcome: str, done: int, total: int) -> None:
            tally(outcome)
            bar.update(task, completed=done, total=total,
                       description=f"{spec.model} b{spec.batch} {spec.strategy}",
                       counts=tallied())

        return sweep(spec_grid, db, backend=backend, ray_address=ray_address,
                     progress=progress, grid_label=label)


@app.command()
@handles_errors
def export(
    db: Annotated[Path, typer.Option(help="results database")],
    out: Annotated[Path, typer.Option(help="output file")],
    format: Annotated[str, typer.Option(help="parquet or csv")] = "parquet",
    table: Annotated[str, typer.Option(help="runs, config_summary, configs, sweeps")] = "runs",
) -> None:
    """Export the dataset as Parquet or CSV."""
    from rematlab.study.store import Store

    with Store(db, read_only=True) as store:
        path = store.export(out, format, table)
    console.print(f"wrote {path}")



@app.command("stats")
@handles_errors
def stats_cmd(
    db: Annotated[Path, typer.Option(help="results database")],
    memory_cap: Annotated[str | None, typer.Option(help="cap for 'enables batch', e.g. 8GiB")]
    = None,
    markdown: Annotated[Path | None, typer.Option(help="also write the tables here")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    include_untrusted: IncludeUntrusted = False,
) -> None:
    """Statistical tests, effect sizes, guidelines and the study's claims on a dataset."""
    from rematlab.study.stats import analyze
    from rematlab.study.store import load

    if markdown is not None:
        refuse_overwriting_inputs(markdown, [db])
    report = analyze(load(db, "config_summary"), load(db, "runs"),
                     memory_cap=parse_bytes(memory_cap) if memory_cap else None,
                     untrusted=include_untrusted)
    if markdown is not None:
        write_text(markdown, report.to_markdown())
    if as_json:
        _print_json(report.to_dict())
        return
    for name, frame in (("claims check", report.claims), ("guidelines", report.guidelines)):
        table = Table(title=name)
        for col in frame.columns:
            table.add_column(str(col))
        for _, row in frame.iterrows():
            table.add_row(*[format_number(v) for v in row])
        console.print(table)
    for note in report.notes:
        console.print(f"note: {note}")



@app.command()
@handles_errors
def fit(
    db: Annotated[Path, typer.Option(help="results database")],
    out: Annotated[Path, typer.Option(help="predictor file (.skops)")] = Path("predictor.skops"),
    as_json: Annotated[bool, typer.Option("--json")] = False,
    include_untrusted: IncludeUntrusted = False,
) -> None:
    """Fit and evaluate the time and memory predictors; print the evaluation table."""
    from rematlab.study.predictor import fit_and_evaluate
    from rematlab.study.store import load

    refuse_overwriting_inputs(out, [db])
    predictor, table, data = fit_and_evaluate(load(db, "config_summary"), out,
                                              untrusted=include_untrusted)
    left_out = data.attrs.get("untrusted_left_out", 0)
    used = data.attrs.get("untrusted_used", 0)
    if used:
        sys.stderr.write(f"warning: too few trusted configurations to fit; {used} timed on a "
                         "busy machine are used too\n")
    if as_json:
        _print_json({"evaluation": table.to_dict(orient="records"),
                     "models": predictor.names_, "predictor": str(out),
                     "configurations": len(data), "untrusted_left_out": left_out,
                     "untrusted_used": used})
        return
    view = Table(title=f"evaluation on {len(data)} configurations (one row per model)"
                 + (f"; {left_out} left out as untrusted" if left_out else ""))
    for col in ("target", "model", "protocol", "r2", "mape", "p90_ape", "n"):
        view.add_column(col, justify="right")
    for _, r in table.iterrows():
        view.add_row(r["target"], r["model"], r["protocol"], f"{r['r2']:.4f}",
                     f"{r['mape']:.2%}", f"{r['p90_ape']:.2%}", str(r["n"]))
    console.print(view)
    console.print(f"chosen: time={predictor.names_['time']}, "
                  f"memory={predictor.names_['memory']}; saved to {out}")


@app.command("predict")
@handles_errors
def predict_cmd(
    predictor: Annotated[Path, typer.Option(help="file written by rematlab fit")],
    model: Annotated[str, typer.Option(help="zoo name or module.path:factory")],
    batch: int = 32,
    strategy: str = "none",
    input: Annotated[str | None, typer.Option(help="input scale")] = None,
    input_shape: Annotated[str | None, typer.Option(help="per-sample shape")] = None,
    device: str = "cpu",
    device_name: Annotated[str | None, typer.Option(help="e.g. 'NVIDIA H100'")] = None,
    dtype: str = "float32",
    optimizer: str = "momentum",
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Predict step time and peak memory of a configuration without running it."""
    from rematlab.measurement.spec import Spec
    from rematlab.study.predictor import predict

    spec = Spec(model=model, batch=batch, strategy=strategy, input=input,
                input_shape=_shape(input_shape), device=device, dtype=dtype,
                optimizer=optimizer)
    result = predict(predictor, spec, device_name=device_name)
    if as_json:
        _print_json(result)
        return
    lo, hi = result["time_s_interval"]
    mlo, mhi = result["peak_bytes_interval"]
    console.print(f"step time {result['time_s'] * 1e3:.2f} ms "
                  f"[{lo * 1e3:.2f}, {hi * 1e3:.2f}] ({result['coverage']:.0%} interval)")
    console.print(f"peak memory {format_bytes(result['peak_bytes'])} "
                  f"[{format_bytes(mlo)}, {format_bytes(mhi)}]")


@app.command()
@handles_errors
def gradients(
    models: Annotated[str, typer.Option(
        help="comma-separated: bert-topics (the paper's regime: a pretrained transformer "
             "fine-tuned with LoRA rank 1), or from scratch: mlp3, mlp5, mlp7, lenet5, "
             "synthetic-mlp5")] = "bert-topics",
    budgets: Annotated[str, typer.Option(help="directions per step for FmAD and ZO")] = "1",
    seeds: int = 5,
    steps: int = 1000,
    batch: Annotated[int, typer.Option(help="samples per step")] = 32,
    finetune: Annotated[bool, typer.Option(
        help="zoo models: frozen pretrained backbone + LoRA adapters")] = False,
    strategy: Annotated[str, typer.Option(
        help="checkpointing for BP+ckpt on zoo models (transformers: layer checkpointing "
             "and the matched-memory plan)")] = "sqrt",
    out: Annotated[Path | None, typer.Option(help="write JSON, table and plots here")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Compare BP+checkpointing with forward-mode AD and zeroth-order training."""
    from rematlab.gradients.comparison import compare
    from rematlab.remat.strategies import parse

    parse(strategy)
    try:
        ks = [int(b) for b in budgets.split(",") if b.strip()]
    except ValueError:
        raise ConfigError(f"budgets {budgets!r} must be comma-separated integers") from None
    if not ks:
        raise ConfigError(f"budgets {budgets!r} names no direction count")
    names = [m.strip() for m in models.split(",") if m.strip()]
    if not names:
        raise ConfigError("--models names no model; e.g. bert-topics or mlp5,lenet5")
    result = compare(names, ks, seeds, steps=steps, batch=batch, finetune=finetune,
                     strategy=strategy, progress=lambda m: sys.stderr.write(f"{m}\n"))
    data = result.to_dict()
    if out is not None:
        _write_gradient_outputs(out, data)
    if as_json:
        _print_json({k: v for k, v in data.items() if k != "runs"})
        return
    view = Table(title="gradient estimators (mean over seeds)")
    cols = ("model", "method", "lr", "final_accuracy", "reached", "steps_to_target",
            "seconds_to_target", "flops_to_target", "peak_bytes", "cosine_to_true_grad",
            "diverged")
    for col in cols:
        view.add_column(col, justify="right")
    for row in data["table"]:
        view.add_row(*[format_number(row[c]) if row[c] is not None else "not reached"
                       for c in cols])
    console.print(view)
    for model, entries in data["verdict"].items():
        for entry in entries.values():
            console.print(f"{model}: {entry['statement']}")


def _write_gradient_outputs(out: Path, data: dict) -> None:
    import base64

    from rematlab.study.figures import gradient_figures

    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "gradients.json", json.dumps(data, indent=2, default=jsonable))
    for name, png in zip(("accuracy_vs_flops", "accuracy_vs_time"), gradient_figures(data),
                         strict=False):
        write_bytes(out / f"{name}.png", base64.b64decode(png))


@app.command()
@handles_errors
def study(
    grid: Annotated[str, typer.Option(help="quick, seed-study or a grid file")] = "quick",
    db: Annotated[Path | None, typer.Option(help="results database")] = None,
    out: Annotated[Path, typer.Option(help="report directory")] = Path("results/study"),
    backend: Annotated[str, typer.Option(help="local or ray")] = "local",
    device: Annotated[str | None, typer.Option(help="override the grid's devices")] = None,
    ops: Annotated[bool | None, typer.Option(
        "--ops/--no-ops", help="the plan stage offers op-level options (save some ops, "
        "recompute the rest); default: the grid's [study] plan_ops, else on")] = None,
) -> None:
    """Reproduce the whole study: sweep, predictors, statistics, plans, gradients, report."""
    from rematlab.measurement.spec import available, parse_device
    from rematlab.study.grid import load_grid
    from rematlab.study.reproduce import StudySettings, run_study

    if device:
        available(parse_device(device))
    spec_grid = load_grid(grid)
    database = db or Path("results") / f"{spec_grid.name}.duckdb"
    settings = StudySettings(grid=grid, db=database, out=out, backend=backend, device=device,
                             plan_ops=ops)

    def runner(g, path):
        return run_sweep(g, path, backend, None, grid)

    try:
        html, md = run_study(settings, say=lambda m: sys.stderr.write(m + "\n"),
                             sweep_runner=runner)
    except KeyboardInterrupt:
        sys.stderr.write(f"interrupted; the sweep is resumable: rerun rematlab study --grid "
                         f"{grid} --db {database} --out {out}\n")
        raise typer.Exit(130) from None
    console.print(f"report: {html} and {md}")

