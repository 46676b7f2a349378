"""`rematlab rent`: which card to rent, how many, with which plan, and what the job costs
(`rematlab.planning.rent`)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from rematlab.cli.app import (
    Clip,
    Example,
    InputDtype,
    InputShape,
    Lora,
    MicroBatches,
    Optimizer,
    Precision,
    StepFn,
    Vocab,
    WeightDtype,
    _print_json,
    _step,
    app,
    console,
    handles_errors,
)
from rematlab.cli.models import ModelSource, model_and_batches
from rematlab.core.checks import bounded
from rematlab.exceptions import ConfigError

MAX_WORK = 10**18  # tokens or samples of one job


@app.command("rent")
@handles_errors
def rent_cmd(
    model: Annotated[str, typer.Option(
        help="zoo name, module.path:factory, or hf:config.json (a Hugging Face config, "
             "built on the meta device)")],
    batch: Annotated[int, typer.Option(help="samples per rank and micro-batch")] = 8,
    tokens: Annotated[float | None, typer.Option(
        help="the work: tokens to train on (1e9, 2.5e10)")] = None,
    samples: Annotated[float | None, typer.Option(help="the work: samples to train on")]
    = None,
    epochs: Annotated[float | None, typer.Option(
        help="the work: epochs over --dataset samples")] = None,
    dataset: Annotated[int | None, typer.Option(help="samples in one epoch")] = None,
    cards: Annotated[str | None, typer.Option(
        help="cards to compare, comma-separated (default: every profile rematlab has)")]
    = None,
    counts: Annotated[str, typer.Option(
        help="cards per job to compare, comma-separated; above 1 data-parallel")] = "1,2,4,8",
    layout: Annotated[str, typer.Option(help="how counts above 1 split the step: fsdp or ddp")]
    = "fsdp",
    prices: Annotated[Path | None, typer.Option(
        help="a JSON file of US dollars per GPU-hour by card, over the shipped table")] = None,
    price: Annotated[list[str] | None, typer.Option(
        help="one card's price, CARD=USD per GPU-hour (repeatable)")] = None,
    largest: Annotated[bool, typer.Option(
        help="also the largest batch per rank that fits, and its throughput")] = True,
    input_shape: InputShape = None,
    input_dtype: InputDtype = "float32",
    vocab: Vocab = None,
    example: Example = None,
    optimizer: Optimizer = "adamw",
    precision: Precision = "bf16",
    micro_batches: MicroBatches = 1,
    clip: Clip = None,
    step_fn: StepFn = None,
    dtype: WeightDtype = "float32",
    lora: Lora = None,
    figure: Annotated[Path | None, typer.Option(
        help="write a figure of cost against hours, one point per configuration (.png, "
             ".svg, .pdf)")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Rent a bigger card or train smarter on a cheaper one? Every card x count priced by
    pre-flight (nothing runs): whether the plain step fits, the fastest plan that does, its
    step time, the job's hours and cost, ranked by cost."""
    from rematlab.planning.prices import parse_price, read_prices
    from rematlab.planning.rent import rent

    work = _work(tokens, samples, epochs, dataset)
    table = {**(read_prices(prices) if prices is not None else {}),
             **{p.card: p for p in map(parse_price, price or [])}}
    wanted = _counts(counts)
    if figure is not None and figure.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ConfigError(f"--figure must end in .png, .svg or .pdf, got {figure.name!r}"
                          [:200])
    source = ModelSource(model, None, input_shape, input_dtype, vocab, example, dtype, lora)
    net, batches = model_and_batches(source, "cpu", predict=True)
    if layout not in ("fsdp", "ddp"):
        raise ConfigError(f"--layout must be fsdp or ddp, got {layout!r}"[:200])
    from dataclasses import replace

    from rematlab.core.layout import DDP, FSDP

    step = replace(_step(optimizer, precision, micro_batches, clip, False, step_fn),
                   layout=FSDP() if layout == "fsdp" else DDP())
    with console.status("pricing") as status:
        result = rent(net, batches(batch), work=work, step=step, cards=cards,
                      counts=wanted, prices=table, largest=largest,
                      progress=lambda what: status.update(f"pricing {what}"))
    if figure is not None:
        _figure(result, figure)
    if as_json:
        _print_json(result.to_dict())
    else:
        _print_result(result, model)


def _work(tokens: float | None, samples: float | None, epochs: float | None,
          dataset: int | None) -> Any:
    """The work from exactly one of --tokens, --samples, or --epochs with --dataset."""
    from rematlab.planning.rent import Work

    given = [tokens is not None, samples is not None, epochs is not None or dataset is not None]
    if sum(given) != 1:
        raise ConfigError("give the work once: --tokens, --samples, or --epochs with --dataset")
    if given[2]:
        if epochs is None or dataset is None:
            raise ConfigError("--epochs and --dataset go together (samples = epochs x dataset)")
        amount, what = epochs * bounded("--dataset", dataset, MAX_WORK), "--epochs x --dataset"
    else:
        amount, what = (tokens, "--tokens") if given[0] else (samples, "--samples")
    if not amount == amount or amount <= 0 or amount > MAX_WORK:  # NaN, zero, negative, huge
        raise ConfigError(f"{what} must be above 0 and at most {MAX_WORK:.0e}, got {amount:g}")
    whole = max(1, round(amount))
    return Work(tokens=whole) if given[0] else Work(samples=whole)


def _counts(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        try:
            out.append(int(part.strip()))
        except ValueError:
            raise ConfigError(f"--counts takes whole numbers, comma-separated, got {text!r}"
                              [:200]) from None
    return out


def _money(x: float | None) -> str:
    return "" if x is None else f"${x:,.0f}" if x >= 100 else f"${x:,.2f}"


def _print_result(result: Any, model: str) -> None:
    """The ranked table, the cheapest and the fastest, the front between them, what remat
    buys against the cheapest card that fits without it, and what did not fit."""
    from rematlab.planning.rent import cost_against_plain

    work = result.work
    console.print(f"{model}: {work.amount:,} {work.unit}, predicted (nothing run: fake "
                  "tensors, each card's roofline)")
    front = {(r.card, r.count) for r in result.pareto()}
    table = Table(title="ranked by cost (* on the cost/hours front)")
    for col in ("card", "n", "plain fits", "recomputed", "peak / upper per rank", "step",
                f"{work.unit}/s", "largest batch", "hours", "$/GPU-h", "cost",
                "vs cheapest plain"):
        table.add_column(col, justify="right" if col != "card" else "left")
    for r in (r for r in result.ranked() if r.fits):
        against = cost_against_plain(result, r)
        table.add_row(f"{r.card}{' *' if (r.card, r.count) in front else ''}", str(r.count),
                      "yes" if r.fits_plain else "no",
                      "none" if not r.remat else f"{r.recomputed} of {r.blocks}",
                      f"{r.peak / 2**30:.1f} / {r.upper / 2**30:.1f} GiB",
                      f"{r.step_s:.3f} s", f"{r.per_s:,.0f}",
                      "" if r.largest_batch is None else str(r.largest_batch),
                      f"{r.hours:,.1f}", "" if r.usd_per_hour is None
                      else f"{r.usd_per_hour:.2f}", _money(r.cost),
                      "" if against is None else f"{against:+.0%}")
    console.print(table)
    for by, word in (("cost", "cheapest"), ("hours", "fastest")):
        try:
            best = result.best(by)
        except ConfigError as exc:
            console.print(f"{word}: {exc}")
            continue
        console.print(f"{word}: {best.count} x {best.card}, {best.hours:,.1f} h, "
                      f"{_money(best.cost) or 'no price'}"
                      + ("" if not best.remat else f", with remat ({best.overhead:+.0%} "
                         "step time)"))
    plain = result.cheapest_plain()
    console.print("without remat: nothing fits" if plain is None else
                  f"cheapest without remat: {plain.count} x {plain.card}, "
                  f"{_money(plain.cost)}")
    if result.misfits:
        console.print(f"{len(result.misfits)} configurations do not fit: "
                      + "; ".join(f"{r.count} x {r.card}" for r in result.misfits[:12])
                      + (" ..." if len(result.misfits) > 12 else "")
                      + " (--json says why)")
    console.print(f"priced in {result.seconds:.0f} s; prices: rematlab.planning.prices "
                  "(dated, sourced) unless --prices/--price")


def _figure(result: Any, path: Path) -> None:
    """Cost against hours, one point per configuration that fits and has a price; plans
    with remat hollow, the front joined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rematlab.core.files import write_bytes

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in (r for r in result.fitting if r.cost is not None):
        ax.scatter(r.hours, r.cost, marker="o", facecolors="none" if r.remat else "C0",
                   edgecolors="C0")
        ax.annotate(f"{r.count}x{r.card}", (r.hours, r.cost), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    front = result.pareto()
    if front:
        ax.plot([r.hours for r in front], [r.cost for r in front], color="C1", lw=1)
    ax.set_xlabel("hours (predicted)")
    ax.set_ylabel("cost (US dollars)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title("each card x count: filled plain, hollow with remat; the front in orange")
    buf = io.BytesIO()
    fig.savefig(buf, format=path.suffix.lstrip(".").lower(), bbox_inches="tight")
    plt.close(fig)
    write_bytes(path, buf.getvalue())
