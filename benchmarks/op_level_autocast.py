"""Op-level plans under bf16 autocast (issue 50), on this CPU: which options pay, measured.

    .venv/bin/python benchmarks/op_level_autocast.py [--rounds 5]
        [--out docs/benchmarks/op-level-autocast.md]

GPT-2, a Llama-style decoder and BERT (4 layers, width 256, 8 x 256 tokens) trained in bf16
autocast with AdamW. For five budgets between the floor and keeping everything: the plan
with op-level options (`prepare(..., ops=True)`), the per-layer plan (`ops=False`),
transformers' `every_n_layers` (the largest n that fits) and torch's `sac_milp` (its largest
budget whose plan's measured peak fits, `sac_milp_peer`); then every layer under each option
of the menu alone (the dispatch-mode save sets; the module-level "recompute mlp.act"), under
torchtitan's op-level policy (`titan_plan`), and checkpointed whole. All step times are
medians of interleaved rounds of the same step (`Step(precision="bf16")`, one timer under the
interference guard), as ratios to keeping everything measured in the same rounds; peaks are
the planner's measured step peaks.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from op_level import _hf_fitting, _hf_run
from real_models import _side_by_side
from sac_milp_peer import SacMilp

from benchmarks.publish import publish
from rematlab.core import hostmem
from rematlab.core.recipe import Step
from rematlab.core.units import format_bytes
from rematlab.planning.planner import prepare
from rematlab.plans.plan import Plan, Segment, Selective
from rematlab.remat.strategies import apply
from tests import realzoo


def titan_plan(model, batch, step: Step, planning) -> Plan:
    """torchtitan's op-level policy on every layer (`torchtitan/.../activation_checkpoint.py`,
    `_custom_policy`): save `aten.mm` outputs except every second one, and the fused attention
    kernels' outputs; recompute the rest. On GPT-2, whose projections run `addmm`, it saves
    no matmul at all."""
    from tests.gpufacts import layer_facts

    layers = layer_facts(model, batch, step, "cpu")
    c = planning.costs
    items = [0]
    for i, facts in enumerate(layers, start=1):
        counts: dict[str, int] = {}
        saves = []
        for op in facts["ops"]:
            k = counts.get(op, 0)
            counts[op] = k + 1
            if (op == "mm" and k % 2 == 0) or op.startswith("_scaled_dot_product"):
                saves.append((f"aten.{op}.default", k))
        items.append(Selective(i, "torchtitan", tuple(saves), ""))
    return Plan(c.n, (*items, c.n - 1))


# the models and the step of the bf16 benchmarks (this one, op_level_planning,
# compile_budget_autocast): 4 layers, width 256, 8 x 256 tokens, AdamW under bf16 autocast
MODELS = {"GPT-2": lambda: realzoo.gpt2(batch=8, seq=256, layers=4, width=256),
          "Llama": lambda: realzoo.llama(batch=8, seq=256, layers=4, width=256)}
# the three transformer configurations: the decoders and BERT, at the same sizes
TRANSFORMERS = {**MODELS,
                "BERT": lambda: realzoo.bert(batch=8, seq=256, layers=4, width=256)}


FRACTIONS = (0.1, 0.3, 0.5, 0.7, 0.9)  # of the way from the floor to keeping everything


def bf16_step() -> Step:
    return Step(precision="bf16", optimizer=torch.optim.AdamW)


def bench(name: str, make, step: Step, rounds: int) -> list[str]:
    """One model's rows: at three budgets the op-level plan, the per-layer plan and
    transformers' `every_n_layers` (the largest that fits); every layer under each option of
    the menu, under torchtitan's policy, and checkpointed whole."""
    torch.manual_seed(0)
    model, batch = make()
    model.train()
    t0 = time.perf_counter()
    ops = prepare(model, batch, step=step, ops=True)
    ops_seconds = time.perf_counter() - t0
    layer = prepare(model, batch, step=step)
    c = ops.costs
    n = c.n
    candidates: dict[str, tuple] = {}
    floor, full = ops.floor_budget(), ops.full
    t0 = time.perf_counter()
    try:
        torch_sac, sac_note = SacMilp(model, batch, step, ops), ""
    except Exception as exc:  # torch's estimators are prototypes: said, not hidden
        torch_sac, sac_note = None, f"its estimators fail here ({type(exc).__name__}: {exc})"
    sac_seconds = [time.perf_counter() - t0]
    for f in FRACTIONS:
        budget = int(floor + f * (full - floor))
        candidates[f"{f:.1f} op-level"] = (ops.choose(budget), budget)
        candidates[f"{f:.1f} per-layer"] = (layer.choose(max(budget, layer.floor_budget())),
                                            budget)
        for k, peak in _hf_fitting(model, ops, budget).items():
            candidates[f"{f:.1f} every_n_layers={k}"] = (("hf", k, peak), budget)
        if torch_sac is None:
            continue
        t0 = time.perf_counter()
        fitting = torch_sac.fitting(budget)
        sac_seconds.append(time.perf_counter() - t0)
        if fitting is not None:
            candidates[f"{f:.1f} sac_milp at {format_bytes(fitting[1])}"] = (fitting[0], budget)
    candidates["every layer checkpointed"] = (Plan(n, (0, *[
        Segment(i, i + 1, (i,)) for i in range(1, n - 1)], n - 1)), None)
    for k, opt in enumerate(c.menu(1)):
        candidates[f"every layer: {opt.name}"] = (Plan(n, (0, *[
            Selective.of(i, c.menu(i)[k]) for i in range(1, n - 1)], n - 1)), None)
    candidates["every layer: torchtitan's policy"] = (titan_plan(model, batch, step, ops),
                                                      None)
    def planned(p: Plan):  # transformers' own checkpointing off first: an HF run may precede
        return lambda: (model.activation_checkpointing_disable(), apply(model, p))[1]
    runs = {k: _hf_run(model, p[1]) if isinstance(p, tuple) else planned(p)
            for k, (p, _) in candidates.items()}
    got, evidence = _side_by_side(runs, batch, model, rounds, step)
    base = got["none"][0]
    lines = [f"### {name}", "",
             f"Timings {'trusted' if evidence.trusted else 'NOT trusted (busy machine)'}. "
             f"rematlab's op-level planning: {ops_seconds:.1f} s. torch's sac_milp: " + (
                 sac_note or f"estimators {sac_seconds[0]:.1f} s, then per budget "
                 f"{min(sac_seconds[1:]):.1f}-{max(sac_seconds[1:]):.1f} s (its MILPs and "
                 "the measured steps of its budget search)") + ".", "",
             "| candidate | budget | plan | measured peak | time / none (± IQR) |",
             "|---|---|---|---|---|"]
    for label, (plan, budget) in candidates.items():
        if isinstance(plan, tuple):
            text, peak = f"transformers every_n_layers={plan[1]}", plan[2]
        else:
            text, peak = plan.describe(), ops.measure(plan)
        lines.append(f"| {label} | {format_bytes(budget) if budget else '—'} | `{text}` | "
                     f"{format_bytes(peak)} | {got[label][0] / base:.3f}x "
                     f"±{got[label][1]:.0%} |")
    return [*lines, ""]


def bf16_main(doc: str, title: str, script: str, bench: Callable[..., list[str]],
              models: dict = MODELS, rounds: int = 5, own_memory: bool = True) -> None:
    """The bf16 benchmarks' command line (`--rounds`, `--out`, `--models`): `bench(name,
    make, step, rounds)`'s rows for each of `models` (or those named) under a header that
    names the command; with `own_memory`, the process keeps the memory it frees
    (`rematlab.core.hostmem`)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--models", default=",".join(models),
                        help=f"comma-separated, among {', '.join(models)}")
    args = parser.parse_args()
    names = args.models.split(",")
    unknown = sorted(set(names) - set(models))
    if unknown:
        parser.error(f"unknown models {', '.join(unknown)}; choose among {', '.join(models)}")
    if own_memory:
        hostmem.own_process()
    step = bf16_step()
    chosen = "" if names == list(models) else f" --models {args.models}"
    lines = [f"# {title}", "",
             f"Produced by `python benchmarks/{script} --rounds {args.rounds}{chosen}` "
             f"(module docstring), torch {torch.__version__}, {torch.get_num_threads()} "
             "threads.", ""]
    for name in names:
        lines += bench(name, models[name], step, args.rounds)
    publish("\n".join(lines) + "\n", args.out)


def main() -> None:
    bf16_main(__doc__, "Op-level plans under bf16 autocast", "op_level_autocast.py", bench,
              models=TRANSFORMERS)


if __name__ == "__main__":
    main()
