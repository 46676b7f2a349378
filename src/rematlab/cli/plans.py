"""Commands on one model: `measure` a configuration, `plan` for budgets, `max-batch`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from rematlab.cli.app import (
    Blocks,
    Budget,
    Clip,
    Ddp,
    Example,
    Fsdp,
    GradsToZero,
    InputDtype,
    InputScale,
    InputShape,
    Lora,
    MicroBatches,
    Optimizer,
    Precision,
    StepFn,
    Target,
    Vocab,
    WeightDtype,
    _layout,
    _print_json,
    _shape,
    _step,
    app,
    console,
    handles_errors,
)
from rematlab.cli.models import ModelSource, model_and_batches
from rematlab.core.checks import bounded
from rematlab.core.files import write_text
from rematlab.core.optimizers import OPTIMIZERS
from rematlab.core.units import format_bytes, parse_bytes
from rematlab.exceptions import ConfigError
from rematlab.planning.budget import checked, is_auto

MAX_BUDGETS = 4096  # budgets of one `plan --budgets` (the guide's bound)


@app.command()
@handles_errors
def measure(
    model: Annotated[str, typer.Option(help="zoo name or module.path:factory")],
    batch: Annotated[int, typer.Option(help="batch size")] = 32,
    strategy: Annotated[str, typer.Option(help="none, uniform:N, every:K, selective[:T], "
                                               "sqrt, plan:FILE.json")] = "none",
    input: Annotated[str | None, typer.Option(help="input scale: mnist, cifar, imagenet")] = None,
    input_shape: Annotated[str | None, typer.Option(help="per-sample shape, e.g. 3,32,32")] = None,
    input_dtype: InputDtype = "float32",
    vocab: Vocab = None,
    example: Example = None,
    blocks: Blocks = None,
    device: str = "cpu",
    dtype: str = "float32",
    optimizer: Annotated[str, typer.Option(help=", ".join(OPTIMIZERS))] = "momentum",
    precision: Annotated[str, typer.Option(
        help="fp32, bf16 or fp16: the step's autocast (fp16 with a GradScaler)")] = "fp32",
    warmup: Annotated[int, typer.Option(
        help="untimed steps before the repeats; the first is the tracked step")] = 1,
    repeats: int = 5,
    max_memory: Annotated[str | None, typer.Option(help="cap, e.g. 512MiB: above it, oom")] = None,
    threads: int | None = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Measure one training configuration: step time, peak memory, saved bytes, FLOPs."""
    from rematlab.measurement.measure import measure as run
    from rematlab.measurement.spec import Spec

    spec = Spec(model=model, batch=batch, strategy=strategy, input=input,
                input_shape=_shape(input_shape), device=device, dtype=dtype,
                optimizer=optimizer, warmup=warmup, repeats=repeats, threads=threads,
                max_memory=parse_bytes(max_memory) if max_memory else None, example=example,
                input_dtype=None if input_dtype == "float32" else input_dtype, vocab=vocab,
                blocks=blocks, precision=None if precision == "fp32" else precision)
    obs = run(spec)
    summary = obs.summary()
    if as_json:
        _print_json(summary)
    else:
        table = Table(title=f"{model} batch {batch} strategy {strategy} on {device}")
        table.add_column("figure")
        table.add_column("value", justify="right")
        table.add_row("outcome", obs.outcome if not obs.error else f"{obs.outcome}: {obs.error}")
        if obs.outcome == "ok":
            for phase in ("step", "forward", "backward", "recompute", "optimizer"):
                table.add_row(f"{phase} time (median ± IQR)",
                              f"{obs.median(phase) * 1e3:.2f} ± {obs.iqr(phase) * 1e3:.2f} ms")
            table.add_row("peak memory", format_bytes(obs.peak or 0))
            table.add_row("saved activations", format_bytes(obs.figures["saved_activation_bytes"]))
            for key in ("forward_flops", "backward_flops", "recompute_flops"):
                table.add_row(key.replace("_", " "), f"{obs.figures[key] / 1e9:.3f} GFLOP")
            table.add_row("plan", str(obs.figures["plan"]))
            if obs.noisy:
                table.add_row("warning", "step time IQR > 10% of median: too noisy to trust")
        console.print(table)
    if obs.outcome == "error":
        raise typer.Exit(1)



@app.command("plan")
@handles_errors
def plan_cmd(
    model: Annotated[str, typer.Option(help="zoo name or module.path:factory")],
    budget: Annotated[str | None, typer.Option(
        help="peak memory budget of the step, e.g. 6GiB, or auto: what this device has")]
    = None,
    budgets: Annotated[str | None, typer.Option(
        help="several budgets, comma-separated (40MiB,60MiB): the model is profiled once")]
    = None,
    batch: int = 32,
    input: InputScale = None,
    input_shape: InputShape = None,
    input_dtype: InputDtype = "float32",
    vocab: Vocab = None,
    example: Example = None,
    blocks: Blocks = None,
    device: str = "cpu",
    optimizer: Optimizer = "momentum",
    precision: Precision = "fp32",
    micro_batches: MicroBatches = 1,
    clip: Clip = None,
    grads_to_zero: GradsToZero = False,
    step_fn: StepFn = None,
    dtype: WeightDtype = "float32",
    lora: Lora = None,
    predict: Annotated[bool, typer.Option(
        help="plan without running: fake-tensor costs, roofline times on --target")] = False,
    target: Target = None,
    compile: Annotated[bool, typer.Option(
        "--compile", help="plan for torch.compile(apply(model, plan)): compiled costs")] = False,
    ops: Annotated[bool, typer.Option(
        "--ops", help="also offer op-level options per block: save some ops' outputs "
        "(matmuls, ...), recompute the rest")] = False,
    offload: Annotated[bool, typer.Option(
        "--offload", help="also offer each layer's saved activations in host memory, priced "
        "on the card's host link (a GPU, or --predict with a GPU --target)")] = False,
    fsdp: Fsdp = None,
    ddp: Ddp = None,
    out: Annotated[Path | None, typer.Option(help="write the plan as JSON here")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """The fastest checkpointing plan whose whole-step peak fits the budget (or each of
    several budgets, from one profile); with --fsdp or --ddp, for one rank of the job."""
    from dataclasses import replace

    import torch.distributed as dist

    from rematlab.distributed.group import leave_job
    from rematlab.planning.options import PlanOptions
    from rematlab.planning.planner import prepare

    options = PlanOptions(blocks=blocks or None, predict=predict, target=target,
                          compile=compile, ops=ops, offload=offload)
    wanted = _budget_list(budget, budgets)
    if out is not None and len(wanted) > 1:
        raise ConfigError("--out writes one plan: give one --budget")
    layout = _layout(fsdp, ddp, predict, device)
    source = ModelSource(model, input, input_shape, input_dtype, vocab, example, dtype, lora)
    net, batches = model_and_batches(source, device, predict)
    step = replace(_step(optimizer, precision, micro_batches, clip, grads_to_zero, step_fn),
                   layout=layout)
    planning = prepare(net, batches(batch), options, step=step)
    summaries = [_plan_summary(planning, b) for b in wanted]
    if layout is not None and not predict:
        rank = dist.get_rank()
        leave_job()
        if rank != 0:
            return  # every rank planned alike: rank 0 reports
    if out is not None:
        write_text(out, json.dumps(summaries[0]["plan_json"]))
    if as_json:
        _print_json(summaries[0] if len(summaries) == 1 else
                    {"structure": planning.structure.describe(), "plans": summaries,
                     "curve": planning.curve()})
    else:
        _print_plans(planning, summaries, budget, out)


def _print_plans(planning: Any, summaries: list[dict], budget: str | None, out: Path | None
                 ) -> None:
    """`plan`'s report: the model's structure, what the plans were predicted for, the plan
    (or one row per budget), each rank's figures, and how to use it."""
    console.print(f"{type(planning.model).__name__}: {planning.structure.describe()}")
    if planning.target is not None:
        console.print(f"predicted for {planning.target.name}, nothing run "
                      f"({planning.target.source})")
    if len(summaries) > 1:
        _print_budget_table(summaries)
    else:
        _print_plan(summaries[0], budget)
        _print_rank(summaries[0].get("per_rank"))
    if out is not None:
        console.print(f"plan written to {out}; use it with --strategy plan:{out}")
    if planning.compile:
        console.print("run it compiled: torch.compile(rematlab.apply(model, plan))")


def _budget_list(budget: str | None, budgets: str | None) -> list[str]:
    """The budgets asked for, each checked before any profiling."""
    if (budget is None) == (budgets is None):
        raise ConfigError("give either --budget or --budgets")
    listed = [budget] if budget is not None else [b.strip() for b in (budgets or "").split(",")]
    if not all(listed):
        raise ConfigError(f"--budgets has an empty entry: {budgets!r}"[:200])
    bounded("the number of --budgets", len(listed), MAX_BUDGETS)
    return [checked(b) for b in listed]


def _plan_summary(planning: Any, budget: str) -> dict:
    """One budget's plan and the fixed strategies beside it, as `rematlab plan` reports it."""
    from dataclasses import asdict

    from rematlab.plans.offload import host_bytes
    from rematlab.plans.simulate import overhead

    derived = planning.budget(budget)
    chosen = planning.choose(derived.nbytes)
    rows = planning.baselines(derived.nbytes)
    return {"plan": chosen.describe(), "structure": planning.structure.describe(),
            "budget": derived.nbytes, "budget_source": derived.how,
            "step": planning.step.describe(), "predicted_peak": chosen.predicted_peak,
            "measured_peak": chosen.measured_peak, "min_peak": chosen.min_peak,
            "reserved_peak": chosen.reserved_peak,
            "host_bytes": host_bytes(chosen.items, planning.costs),
            "predicted_overhead": overhead(chosen.predicted_time or 0.0, rows[0].time),
            "overhead_interval": (list(planning.overhead_interval(chosen))
                                  if planning.target is not None else None),
            "target": planning.target.name if planning.target is not None else None,
            "baselines": [asdict(r) for r in rows], "plan_json": json.loads(chosen.to_json()),
            **({"per_rank": asdict(planning.rank(chosen))} if planning.ranks else {})}


def _print_plan(summary: dict, budget: str | None) -> None:
    limit, rows = summary["budget"], summary["baselines"]
    if budget is not None and is_auto(budget):
        console.print(f"budget {format_bytes(limit)}: {summary['budget_source']}")
    console.print(f"plan: {summary['plan']}  (for the step: {summary['step']})")
    if summary.get("host_bytes"):
        console.print(f"offloaded to host memory (pinned) at once: "
                      f"{format_bytes(summary['host_bytes'])}")
    console.print(f"predicted peak {format_bytes(summary['predicted_peak'] or 0)}"
                  + (f", measured {format_bytes(summary['measured_peak'])}"
                     if summary["measured_peak"] else "")
                  + (f", reserved on the card {format_bytes(summary['reserved_peak'])}"
                     if summary.get("reserved_peak") else "")
                  + f" (budget {format_bytes(limit)}, floor "
                  f"{format_bytes(summary['min_peak'] or 0)});"
                  f" predicted time overhead {summary['predicted_overhead']:+.1%}"
                  + (" ({:+.1%} to {:+.1%})".format(*summary["overhead_interval"])
                     if summary["overhead_interval"] else ""))
    table = Table(title="versus fixed strategies (simulated)")
    for col in ("strategy", "peak", "x none", "time overhead", "fits"):
        table.add_column(col, justify="right")
    table.add_row("optimal", format_bytes(summary["predicted_peak"] or 0),
                  f"{(summary['predicted_peak'] or 0) / rows[0]['peak']:.2f}",
                  f"{summary['predicted_overhead']:+.1%}", "yes")
    for r in rows:
        table.add_row(r["strategy"], format_bytes(r["peak"]), f"{r['peak_ratio']:.2f}",
                      f"{r['overhead']:+.1%}", "yes" if r["fits"] else "no")
    console.print(table)


def _print_rank(found: dict | None) -> None:
    """One rank's peak under the layout, and what held it at that moment."""
    if not found:
        return
    table = Table(title=f"one rank of {found['world_size']}, at its peak "
                  f"({found['method']})")
    for col in ("held by", "bytes"):
        table.add_column(col, justify="right")
    for kind, nbytes in found["breakdown"].items():
        table.add_row(kind, format_bytes(nbytes))
    table.add_row("peak", format_bytes(found["peak"]))
    console.print(table)


def _print_budget_table(summaries: list[dict]) -> None:
    table = Table(title="one plan per budget (profiled once)")
    for col in ("budget", "plan", "predicted peak", "measured peak", "time overhead"):
        table.add_column(col, justify="right")
    for s in summaries:
        table.add_row(format_bytes(s["budget"]), s["plan"],
                      format_bytes(s["predicted_peak"] or 0),
                      format_bytes(s["measured_peak"]) if s["measured_peak"] else "",
                      f"{s['predicted_overhead']:+.1%}")
    console.print(table)


@app.command("max-batch")
@handles_errors
def max_batch_cmd(
    model: Annotated[str, typer.Option(help="zoo name or module.path:factory")],
    budget: Budget,
    batch: Annotated[int, typer.Option(help="the batch size the search starts from")] = 8,
    input: InputScale = None,
    input_shape: InputShape = None,
    input_dtype: InputDtype = "float32",
    vocab: Vocab = None,
    example: Example = None,
    blocks: Blocks = None,
    device: str = "cpu",
    optimizer: Optimizer = "momentum",
    precision: Precision = "fp32",
    micro_batches: MicroBatches = 1,
    clip: Clip = None,
    grads_to_zero: GradsToZero = False,
    step_fn: StepFn = None,
    dtype: WeightDtype = "float32",
    lora: Lora = None,
    predict: Annotated[bool, typer.Option(
        help="predict without running: fake-tensor costs, roofline times on --target")]
    = False,
    target: Target = None,
    limit: Annotated[int, typer.Option(help="largest batch size tried")] = 65536,
    repeats: Annotated[int, typer.Option(help="timed steps per result (0: no timing)")] = 5,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """The largest batch that fits the budget without remat and with the optimal plan, and
    the throughput (samples/s) of each: does remat pay off for this model?"""
    from rematlab.planning.maxbatch import SearchOptions, max_batch
    from rematlab.planning.options import PlanOptions

    budget = checked(budget)
    if batch < 2:
        raise ConfigError(f"--batch must be at least 2 (the search profiles it and twice it), "
                          f"got {batch}")
    options = PlanOptions(blocks=blocks or None, predict=predict, target=target)
    search = SearchOptions(start=batch, limit=limit, repeats=repeats)
    source = ModelSource(model, input, input_shape, input_dtype, vocab, example, dtype, lora)
    net, batches = model_and_batches(source, device, predict)
    step = _step(optimizer, precision, micro_batches, clip, grads_to_zero, step_fn)
    found = max_batch(net, batches, budget, options, search=search, step=step)
    if as_json:
        _print_json(found.to_dict())
    else:
        _print_search(found, model)


def _print_search(found: Any, model: str) -> None:
    """`max-batch`'s report: the budget, the largest batch each way with its peaks, step
    time and throughput, and the verdict."""
    console.print(f"budget {format_bytes(found.budget.nbytes)}: {found.budget.how}")
    if found.target is not None:
        console.print(f"predicted for {found.target}: fake-tensor costs and roofline step "
                      "times, nothing run")
    table = Table(title=f"{model}: the largest batch within the budget")
    for col in ("remat", "batch", "measured peak", "batch+1 peak", "step", "samples/s",
                "plan"):
        table.add_column(col, justify="right")
    for f in found.fits:
        step = (f"{f.step_s * 1e3:.1f} ms ± {(f.step_iqr or 0) * 1e3:.1f}" if f.step_s
                else "")
        table.add_row(f.case, f"{f.batch}{'+' if f.at_limit else ''}",
                      format_bytes(f.peak) if f.peak else "",
                      format_bytes(f.over) if f.over else "", step,
                      f"{f.throughput:.1f}" if f.throughput else "", f.plan or "")
    console.print(table)
    console.print(found.verdict())
    console.print(f"search {found.search_s:.1f} s, timing {found.timing_s:.1f} s")


