"""Real models, planned without wrappers: floor, unconstrained peak, the plan against the
baselines a user has, simulated against measured peak, planning time.

    python benchmarks/real_models.py [--quick] [--out docs/benchmarks/real-models.md]

Models: tests/realzoo.py (GPT-2 and BERT from transformers configs, a ResNet with in-place
ReLU, a U-Net, a decoder with several inputs), at sizes a 2-core CPU runs in minutes.
Baselines that fit the same budget: for chains, every `uniform:N`; for models running their
own layer loop, transformers' own `activation_checkpointing_enable(every_n_layers=k)` where
the model supports it, else `every:1`. Peaks are rematlab's step peak of the user's step
(output alive, momentum SGD state). Times are ratios to `none`, measured side by side in one
process: interleaved rounds, each candidate's median over rounds, so a busy machine slows all
candidates alike; a candidate whose spread across rounds exceeds 10 % is marked noisy.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rematlab.core.guard import Evidence
from rematlab.core.recipe import Step
from rematlab.core.timer import Timer, Turns
from rematlab.core.units import format_bytes
from rematlab.exceptions import InfeasibleBudgetError
from rematlab.planning.planner import prepare
from rematlab.plans.fixed import uniform_plan
from rematlab.plans.plan import Plan
from rematlab.remat.strategies import apply
from tests import realzoo

SIZES = {"gpt2": {"batch": 8, "seq": 128, "layers": 6}, "bert": {"batch": 8, "seq": 128,
                                                                  "layers": 6},
         "resnet": {"batch": 32, "size": 32}, "unet": {"batch": 8, "size": 64},
         "decoder": {"batch": 16, "seq": 48}}
FRACTIONS = (0.0, 0.5)
NOISY = 0.10


def _side_by_side(runs: dict, batch, model, rounds: int, step: Step | None = None
                  ) -> tuple[dict[str, tuple], Evidence]:
    """Median seconds per training step (`step`: rematlab's own by default) of each
    candidate over interleaved rounds, by the one timer (`rematlab.core.timer`, under the
    interference guard), and the relative spread (IQR / median). A candidate is a factory
    that readies the model (transformers' own checkpointing is switched on the shared
    model), called when its turn comes, untimed; on a transformers model, `none` switches it
    off, and it is off afterwards."""
    step = step or Step()
    hf = _hf_layers(model)
    if hf:
        runs = {**runs, "none": lambda: (model.activation_checkpointing_disable(), model)[1]}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt = step.make_optimizer(model.parameters())
    ready = Turns(runs)  # readied again whenever another candidate ran in between

    def work(name: str):
        def one(clock):
            return step.train_step(model, batch, run=ready(name), optimizer=opt,
                                   clock=clock)
        return one

    timing = Timer(next(model.parameters()).device).run(
        {name: work(name) for name in runs}, rounds, warmup=1)
    model.load_state_dict(state)
    if hf:
        model.activation_checkpointing_disable()
    return {name: (timing.median(name), timing.iqr(name) / timing.median(name))
            for name in runs}, timing.evidence


def _hf_layers(model) -> bool:
    return hasattr(model, "activation_checkpointing_enable") and getattr(
        model, "supports_gradient_checkpointing", False)


def bench(name: str, rounds: int) -> tuple[list[str], list[str]]:
    torch.manual_seed(0)
    model, batch = realzoo.MODELS[name](**SIZES[name])
    model.train()
    t0 = time.perf_counter()
    planning = prepare(model, batch)
    try:
        planning.choose(1)
    except InfeasibleBudgetError as err:
        floor = err.min_peak
    full_plan = planning.choose(10 * 2**40)
    plan_s = time.perf_counter() - t0
    full = full_plan.measured_peak
    st = planning.structure
    n = planning.costs.n
    rows, timing = [], []
    for frac in FRACTIONS:
        budget = int(floor + frac * (full - floor))
        t1 = time.perf_counter()
        chosen = planning.choose(budget)
        choose_s = time.perf_counter() - t1
        runs = {"none": lambda: model,
                "plan": lambda chosen=chosen: apply(model, chosen, example_input=batch)}
        fitting: list[tuple[str, int]] = []
        if st.kind == "chain":
            for k in range(2, n + 1):
                p = uniform_plan(n, k)
                peak = planning.measure(p)
                if peak <= budget:
                    fitting.append((f"uniform:{k}", peak))
                    runs[f"uniform:{k}"] = lambda p=p: apply(model, p, example_input=batch)
        elif _hf_layers(model):
            layers = len(st.blocks)
            for k in range(1, layers + 1):
                model.activation_checkpointing_enable(every_n_layers=k)
                peak = planning.measure(Plan(n, tuple(range(n))))  # none of ours: HF's own
                model.activation_checkpointing_disable()
                if peak <= budget:
                    fitting.append((f"HF every_n_layers={k}", peak))

                    def hf(k: int = k):
                        model.activation_checkpointing_disable()
                        model.activation_checkpointing_enable(every_n_layers=k)
                        return model
                    runs[f"HF every_n_layers={k}"] = hf
        else:
            every = apply(model, "every:1", example_input=batch)
            peak = planning.measure(every._rematlab.plan)
            if peak <= budget:
                fitting.append(("every:1", peak))
                runs["every:1"] = lambda: apply(model, "every:1", example_input=batch)
        got, evidence = _side_by_side(runs, batch, model, rounds)
        base = got["none"][0]
        best = min((got[f][0] / base, f, peak) for f, peak in fitting) if fitting else None
        sim_err = (chosen.predicted_peak - chosen.measured_peak) / chosen.measured_peak
        noisy = [k for k, (_, spread) in got.items() if spread > NOISY]
        rows.append(
            f"| {name} | {st.kind} ({len(st.blocks)}) | {format_bytes(floor)} | "
            f"{format_bytes(full)} | {format_bytes(budget)} | `{chosen.describe()}` | "
            f"{format_bytes(chosen.predicted_peak)} / {format_bytes(chosen.measured_peak)} "
            f"({sim_err:+.1%}) | {got['plan'][0] / base:.3f}x | "
            + (f"{best[1]}: {best[0]:.3f}x ({format_bytes(best[2])})" if best else "none fits")
            + f" | {plan_s:.1f} s + {choose_s:.1f} s |")
        timing.append(f"| {name} | {format_bytes(budget)} | " + ", ".join(
            f"{k} {v[0] * 1e3:.1f} ms ±{v[1]:.0%}" for k, v in got.items())
            + (f" | noisy: {', '.join(noisy)}" if noisy else " | ")
            + f" | {'yes' if evidence.trusted else 'no'} (load {evidence.load or 0:.0%}) |")
    return rows, timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two rounds")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rounds = 2 if args.quick else 5
    torch.set_num_threads(2)
    lines = ["| model | driven as (blocks) | floor | unconstrained | budget | plan | "
             "simulated / measured peak | plan time / none | best baseline that fits | "
             "planning (prepare + choose) |", "|---" * 10 + "|"]
    timing = ["| model | budget | median step time ± spread (IQR / median) | noisy | "
              "trusted by the guard |", "|---|---|---|---|---|"]
    t0 = time.perf_counter()
    for name in realzoo.MODELS:
        r, t = bench(name, rounds)
        lines += r
        timing += t
        print(r, flush=True)
    text = ("# Real models: planned without wrappers\n\nProduced by `python "
            "benchmarks/real_models.py --out docs/benchmarks/real-models.md` (module docstring: "
            "what is measured and how). Peaks are rematlab's step peak of the user's step "
            "(output alive, momentum SGD); `simulated / measured` is the planner's model "
            "against that measurement; times are medians over interleaved rounds, as ratios "
            "to `none` measured side by side.\n\n" + "\n".join(lines)
            + "\n\nRaw times:\n\n" + "\n".join(timing)
            + f"\n\nWall time: {time.perf_counter() - t0:.0f} s; torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads.\n")
    if args.out:
        from rematlab.core.files import write_text

        write_text(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
