"""Op-level plans against block-level plans and the one-liners users have, on this CPU.

    .venv/bin/python benchmarks/op_level.py [--quick] [--out docs/benchmarks/op-level.md]

For each model (GPT-2, BERT and a Llama-style decoder from transformers configs; a
ResNet-style CNN; VGG-16 from the zoo) and five budgets from the op-level floor to the
unconstrained peak: the op-level plan (`prepare(..., ops=True).choose`), the block/layer plan
(`prepare(...).choose`), transformers' `every_n_layers` (the largest n that fits) and "save
matmuls" on every layer (every matmul's output; torchtitan's policy saves `aten.mm` only and
recomputes every second one; where it fits), and `torch.compile` of the
plain model with the partitioner's `activation_memory_budget` at `COMPILE_FRACTIONS` (the
largest fraction whose compiled step fits). Peaks are measured by the planner's own step
measurement (compiled steps: the allocator's trace, which sees inside compiled code); step
times are medians of interleaved rounds by the one timer (`benchmarks/real_models._side_by_
side`, under the interference guard), as ratios to keeping everything measured in the same
rounds. A compiled fraction is timed in its own side-by-side run against keeping everything
(dynamo keeps one compiled graph per model, so two fractions cannot share a run). Planning
times are wall-clock seconds of one run. Each model's Pareto figure (measured peak against
time ratio, every candidate) is written next to the document. The process keeps the memory it
frees (`rematlab.core.hostmem`), so that a candidate's step does not pay page faults
that depend on which candidate ran before it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_models import _hf_layers, _side_by_side

from rematlab.core import hostmem
from rematlab.core.units import format_bytes
from rematlab.measurement import zoo
from rematlab.planning.planner import Planning, prepare
from rematlab.planning.verify import step_peak
from rematlab.plans.plan import Plan, Selective
from rematlab.remat.ops import MATMULS
from rematlab.remat.strategies import apply
from tests import realzoo

FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
READING = """## Reading

- **Noise.** Each model's line above says how far apart the same plan measured twice in one
  run came (where the op-level and the block plan are the same plan): differences between two
  plans smaller than that are not resolved on this VM, whatever the rounds' spreads say.
- **Why op-level options gain little on this CPU** (the *floors* rows: a layer's forward
  plain and under selective checkpointing's dispatch mode, its backward plain and with the
  recomputation of everything but the matmuls, as a step under the option measures it, and
  what checkpointing it whole adds). Recomputing the pointwise ops, softmax and layer norms
  takes more than half of what recomputing the whole layer takes: on two CPU cores those
  memory-bound ops are not cheap beside oneDNN's matmuls. An option then buys less than half
  of a layer's activations for more than half of a whole-layer recomputation's time, the
  solver's choice stays close to the per-layer plan's, and the gains in *Against the goals*
  come at some mid budgets and sit within the noise at others. What would change
  it: a device where matmuls dominate a layer's time (a GPU, at a width of thousands), where
  pointwise recomputation costs a few per cent of the layer and Megatron-style options pay.
- **torch.compile** fuses the pointwise ops: where a fraction fits, compare its column with
  the eager ones; whether it reaches below the eager floor shows in each figure's compile
  points, and its peak is not monotone in `activation_memory_budget` (pytorch#197838). Op-
  level plans are eager plans: a compiled op-level plan is refused (`ops=True` with
  `compile=True`), and block plans can be planned for the compiled step (`compile=True`,
  docs/benchmarks/planner.md).
"""
COMPILE_FRACTIONS = (0.0, 0.5, 1.0)  # torch._functorch.config.activation_memory_budget


def _models() -> dict:
    def vgg16():
        net, shape, _ = zoo.resolve("vgg16", "cifar")
        return net, torch.randn(16, *shape)

    return {"gpt2": lambda: realzoo.gpt2(batch=8, seq=256, layers=6, width=256),
            "bert": lambda: realzoo.bert(batch=8, seq=256, layers=6, width=256),
            "llama": lambda: realzoo.llama(batch=8, seq=256, layers=6, width=256),
            "resnet": lambda: realzoo.resnet(batch=32, size=32),
            "vgg16": vgg16}


def _save_matmuls(planning: Planning) -> Plan | None:
    """Every block with a menu under its option that saves exactly its matmuls."""
    c = planning.costs
    items = []
    for i in range(c.n):
        opt = next((o for o in c.menu(i) if o.saves and all(n in MATMULS for n, _ in o.saves)),
                   None)
        items.append(Selective.of(i, opt) if opt else i)
    return Plan(c.n, tuple(items)) if any(isinstance(it, Selective) for it in items) else None


def _compiled(model, batch, planning: Planning, rounds: int) -> dict[float, tuple]:
    """Per `activation_memory_budget` fraction: the compiled plain step's measured peak, and
    its time ratio to keeping everything (eager) with the ratio's spread, side by side."""
    n = planning.costs.n
    out = {}
    for fraction in COMPILE_FRACTIONS:
        torch._dynamo.reset()  # a fraction is read when a graph is compiled
        with torch._functorch.config.patch(activation_memory_budget=fraction):
            peak = planning.measure(Plan(n, tuple(range(n)), compiled=True))
            fn = torch.compile(model, dynamic=False)
            got, _ = _side_by_side({"none": lambda: model, "compiled": lambda fn=fn: fn},
                                   batch, model, rounds)
        out[fraction] = (peak, got["compiled"][0] / got["none"][0],
                         max(got["compiled"][1], got["none"][1]))
    torch._dynamo.reset()
    return out


def pareto(name: str, points: dict[str, list[tuple[int, float]]], where: Path) -> Path:
    """One figure: every candidate's measured peak against its time ratio to keeping
    everything, a line per kind of plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, pts in points.items():
        pts = sorted(set(pts))
        if pts:
            ax.plot([p / 2**20 for p, _ in pts], [t for _, t in pts], marker="o",
                    linestyle="-" if len(pts) > 1 else "none", label=label)
    ax.set_xlabel("measured step peak (MiB)")
    ax.set_ylabel("step time / keeping everything")
    ax.set_title(f"{name}: memory against time, this CPU")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = where / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def summary(name: str, floors: tuple[int, int], got: list[tuple[float, dict, bool]]) -> str:
    """One line on the issue's goals: floors, never slower than the block plan beyond the
    noise (the larger of the two spreads; not judged where both are the same plan), the
    overhead against the best per-layer plan at mid budgets (0.25-0.75), and how far apart
    the same plan came where both are it (the run's own noise, reported, not judged by)."""
    slower, mid, twice = [], [], []
    for frac, row, same in got:
        op, block = row["op-level"], row.get("block")
        if block and same:
            twice.append(abs(op[0] / block[0] - 1))
        if block and not same and op[0] > block[0] * (1 + max(op[1], block[1])):
            slower.append(f"{frac:.2f}")
        per_layer = [v[0] for k, v in row.items() if k == "block" or k.startswith("every_n")]
        if 0.2 < frac < 0.8 and per_layer and min(per_layer) > 1:
            mid.append(1 - (op[0] - 1) / (min(per_layer) - 1))
    return (f"- **{name}**: op-level floor {format_bytes(floors[0])} "
            f"{'≤' if floors[0] <= floors[1] else '>'} block floor {format_bytes(floors[1])}; "
            f"slower than the block plan beyond the noise at: {', '.join(slower) or 'none'}; "
            "time overhead against the best per-layer plan at mid budgets: "
            + (", ".join(f"{-v:+.0%}" for v in mid) if mid else "n/a")
            + (f"; the same plan measured twice: up to {max(twice):.0%} apart" if twice
               else ""))


def bench(name: str, make, rounds: int, figures: Path | None
          ) -> tuple[list[str], str, Path | None]:
    torch.manual_seed(0)
    model, batch = make()
    model.train()
    t0 = time.perf_counter()
    ops = prepare(model, batch, ops=True)
    ops_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    blocks = prepare(model, batch)
    blocks_s = time.perf_counter() - t0
    floor, block_floor = ops.floor_budget(), blocks.floor_budget()
    full = blocks.choose(10 * 2**40).measured_peak
    matmuls = _save_matmuls(ops)
    matmul_peak = ops.measure(matmuls) if matmuls else None
    compiled = _compiled(model, batch, blocks, rounds)
    points: dict[str, list[tuple[int, float]]] = {
        "op-level": [], "block/layer": [], "every_n_layers": [], "save matmuls": [],
        "torch.compile (activation_memory_budget)": [(p, r) for p, r, _ in compiled.values()],
        "keep everything": [(full, 1.0)]}
    rows, ratios = [], []
    for frac in FRACTIONS:
        budget = round(floor + frac * (full - floor))  # 1.0: exactly the unconstrained peak
        mine = ops.choose(budget)
        runs = {"none": lambda: model,
                "op-level": lambda p=mine: apply(model, p, example_input=batch)}
        fits = {}
        theirs = None
        if budget >= block_floor:
            theirs = blocks.choose(budget)
            runs["block"] = lambda p=theirs: apply(model, p, example_input=batch)
            fits["block"] = theirs.measured_peak
        if matmuls is not None and matmul_peak <= budget:
            runs["save matmuls"] = lambda: apply(model, matmuls, example_input=batch)
            fits["save matmuls"] = matmul_peak
        hf = _hf_fitting(model, blocks, budget) if _hf_layers(model) else {}
        for k, peak in hf.items():
            runs[f"every_n_layers={k}"] = _hf_run(model, k)
            fits[f"every_n_layers={k}"] = peak
        got, evidence = _side_by_side(runs, batch, model, rounds)
        base = got["none"][0]
        ratios.append((frac, {k: (v[0] / base, v[1]) for k, v in got.items()},
                       theirs is not None and theirs.describe() == mine.describe()))
        fits["op-level"] = mine.measured_peak
        for key, kind in (("op-level", "op-level"), ("block", "block/layer"),
                          ("save matmuls", "save matmuls")):
            if key in got:
                points[kind].append((fits[key], got[key][0] / base))
        points["every_n_layers"] += [(fits[k], got[k][0] / base) for k in got
                                     if k.startswith("every_n")]

        def cell(key: str, got=got, base=base, fits=fits) -> str:
            if key not in got:
                return "does not fit"
            return f"{got[key][0] / base:.3f}x ±{got[key][1]:.0%} ({format_bytes(fits[key])})"

        fitting = [f for f, (peak, _, _) in compiled.items() if peak <= budget]
        best = max(fitting, default=None)
        compile_cell = ("does not fit" if best is None else
                        f"{best:g}: {compiled[best][1]:.3f}x ±{compiled[best][2]:.0%} "
                        f"({format_bytes(compiled[best][0])})")

        best_hf = min((k for k in got if k.startswith("every_n")), default=None,
                      key=lambda k: got[k][0])
        rows.append(
            f"| {name} | {frac:.2f} | {format_bytes(budget)} | `{mine.describe()}` | "
            f"{format_bytes(mine.measured_peak)} | {got['op-level'][0] / base:.3f}x "
            f"±{got['op-level'][1]:.0%} | {cell('block')} | "
            + (f"{best_hf}: {cell(best_hf)}" if best_hf else "—") + f" | {cell('save matmuls')} "
            f"| {compile_cell} | {ops_s:.1f} s / {blocks_s:.1f} s | "
            f"{'yes' if evidence.trusted else 'no'} |")
        print(rows[-1], flush=True)
    rows.append(f"| {name} | floors | op-level {format_bytes(floor)}, block "
                f"{format_bytes(block_floor)}, unconstrained {format_bytes(full)} | "
                + _dispatch_cost(ops) + " | | | | | | | | |")
    figure = pareto(name, points, figures) if figures is not None else None
    return rows, summary(name, (floor, block_floor), ratios), figure


def _dispatch_cost(planning: Planning) -> str:
    """What selective checkpointing costs a block: its forward under the caching dispatch
    mode and its backward with the recomputation against its plain ones (the planner's
    times, options' as a step under them measures, `layer_costs._options_in_step`)."""
    c = planning.costs
    i = next((i for i in range(c.n) if c.menu(i)), None)
    if i is None:
        return "no block has a useful option"
    return (f"block {i}: forward {c.fwd_time[i] * 1e3:.1f} ms plain, "
            f"{min(o.fwd_time for o in c.menu(i)) * 1e3:.1f} ms under selective checkpointing;"
            f" backward {c.bwd_time[i] * 1e3:.1f} ms plain, "
            f"{min(o.bwd_time for o in c.menu(i)) * 1e3:.1f} ms with its recomputation; "
            f"checkpointing it whole adds {c.fwd_time[i] * 1e3:.1f} ms")


def _hf_fitting(model, planning: Planning, budget: int) -> dict[int, int]:
    """transformers' `every_n_layers=k` with the largest k whose measured peak fits (the
    fewest checkpointed layers, so the fastest of those that fit)."""
    for k in range(len(planning.structure.blocks), 0, -1):
        model.activation_checkpointing_enable(every_n_layers=k)
        # the model itself, its own checkpointing on: no plan goes on top (rematlab refuses
        # to checkpoint inside transformers' checkpoints)
        peak = step_peak(model, model, planning.batch, planning.costs, planning.step)
        model.activation_checkpointing_disable()
        if peak <= budget:
            return {k: peak}
    return {}


def _hf_run(model, k: int):
    def ready():
        model.activation_checkpointing_disable()
        model.activation_checkpointing_enable(every_n_layers=k)
        return model
    return ready


def planning_time_gpt2_12() -> str:
    model, batch = realzoo.gpt2(batch=8, seq=256, layers=12, width=256)
    model.train()
    t0 = time.perf_counter()
    planning = prepare(model, batch, ops=True)
    planning.choose(int(planning.floor + 0.5 * (planning.full - planning.floor)))
    return (f"Planning GPT-2 with 12 layers (width 256, 8 x 256 tokens), op-level menus, "
            f"profiling and a verified choice included: {time.perf_counter() - t0:.1f} s.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two rounds")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    rounds = 2 if args.quick else 5
    hostmem.retain_freed_memory()
    allocator = hostmem.describe()
    lines = ["| model | budget (floor → unconstrained) | budget | op-level plan | measured peak "
             "| op-level time / none | block plan | every_n_layers (largest that fits) | "
             "save matmuls | torch.compile (largest fraction that fits) | "
             "planning (op / block) | trusted |", "|---" * 12 + "|"]
    summaries, figures = [], []
    where = args.out.parent / "op-level" if args.out else None
    for name, make in _models().items():
        rows, line, figure = bench(name, make, rounds, where)
        lines += rows
        summaries.append(line)
        if figure is not None:
            figures.append(f"![{name}](op-level/{figure.name})")
    text = ("# Op-level plans\n\nProduced by `python benchmarks/op_level.py` (module docstring: "
            "what is measured and how), " + time.strftime("%Y-%m-%d") + f", torch "
            f"{torch.__version__}, 2 threads. Times are median step times over {rounds} "
            "interleaved rounds as ratios to keeping everything (± IQR / median); peaks in "
            f"brackets are measured. Host allocator: {allocator}.\n\n" + "\n".join(lines)
            + "\n\n## Against the goals\n\n"
            + "\n".join(summaries) + "\n\n" + planning_time_gpt2_12() + "\n\n" + READING
            + ("\n## Pareto figures\n\n" + "\n\n".join(figures) + "\n" if figures else ""))
    if args.out:
        from rematlab.core.files import write_text

        write_text(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
