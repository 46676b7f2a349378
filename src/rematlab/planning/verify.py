"""Measured peaks of planned steps: what the planner verifies a plan by, on the device, with
the one step-peak probe (`rematlab.core.probes.peak_of`), and the table of fixed strategies
a plan is shown against."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from rematlab.core.batch import tensors
from rematlab.core.probes import StepMemory, one_phase, peak_of
from rematlab.core.recipe import Step
from rematlab.core.steps import preserved
from rematlab.plans.fixed import (
    every_layer_plan,
    none_plan,
    selective_per_layer,
    selective_plan,
    sqrt_plan,
    uniform_plan,
)
from rematlab.plans.plan import ChainCosts, Plan
from rematlab.plans.simulate import overhead, simulate
from rematlab.remat.block import compiled, compiling
from rematlab.remat.layers import LayerRemat, attach
from rematlab.remat.strategies import RematChain


def measure_peak(chain: list[nn.Module], chosen: Plan, x: torch.Tensor,
                 costs: ChainCosts, step: Step | None = None) -> int:
    """Measured peak of the user's training step (`Step.backward_passes`; rematlab's own
    by default) under `chosen` (compiled if `chosen.compiled`) with the optimizer state's
    bytes allocated, then the optimizer step's peak from `costs` (which was measured on
    tensors shaped like the parameters). Parameters, buffers and RNG are restored."""
    step = step or Step()
    remat = RematChain(chain, chosen)
    run = compiled(remat) if chosen.compiled else remat
    with compiling():
        if chosen.compiled:  # compile forward and backward outside the measurement
            with preserved(remat):
                step.micro_batch(run, x)
        return step_peak(remat, run, x, costs, step, tensors_seen=not chosen.compiled)


def measure_layers_peak(model: nn.Module, layers: list[nn.Module], chosen: Plan,
                        batch: object, costs: ChainCosts, step: Step | None = None) -> int:
    """Measured peak of the user's step with `chosen` installed on the model's layers (the
    whole model compiled if `chosen.compiled`, as `torch.compile(apply(model, plan))`)."""
    step = step or Step()
    twin = attach(model, LayerRemat(layers, chosen))
    if not chosen.compiled:
        return step_peak(model, twin, batch, costs, step)
    run = compiled(twin)
    with compiling():
        with preserved(model):  # compile forward and backward outside the measurement
            step.micro_batch(run, batch)
        return step_peak(model, run, batch, costs, step, tensors_seen=False)


def step_peak(owner: nn.Module, run: Callable, batch: object, costs: ChainCosts,
              step: Step, tensors_seen: bool = True) -> int:
    """Peak bytes of the user's step (`Step.backward_passes`: its micro-batches, autocast,
    loss scaling and clipping) of `run` on `batch` by `probes.StepMemory`, with `owner`'s
    parameters, buffers, the batch and the optimizer state's bytes (`costs.state`) alive
    (tensors counted only where the tracker sees them: eager code); at least the optimizer
    step's peak (`ChainCosts.optimizer_peak`). `owner`'s gradients, buffers and the RNG are
    restored."""
    device = next(tensors(batch)).device
    state = torch.empty(costs.state, dtype=torch.uint8, device=device)
    with preserved(owner):
        memory = peak_of(StepMemory(device, tensors_seen=tensors_seen),
                         [*owner.parameters(), *owner.buffers(), *tensors(batch), state],
                         one_phase(lambda: step.backward_passes(run, batch, owner)))
    del state
    return max(memory.peak, costs.optimizer_peak)


def strategy_table(costs: ChainCosts, budget: int | None = None, per_layer: bool = False
            ) -> list[dict]:
    """Simulated peak and time of the fixed strategies (and the best uniform count that fits
    `budget`) on one chain: the rows of `rematlab plan`'s comparison table. `per_layer`: a
    model running its own layer loop, where the baseline is every layer checkpointed
    (transformers' gradient checkpointing) and selective's picks one layer each."""
    n = costs.n
    rows = []
    none_peak, none_time = simulate(none_plan(n), costs)
    if per_layer:
        fixed = [none_plan(n), every_layer_plan(n),
                 selective_per_layer(costs)]
    else:
        uniform = [uniform_plan(n, k) for k in range(2, n + 1)]
        fitting = [p for p in uniform if budget is None or simulate(p, costs)[0] <= budget]
        best_uniform = min(fitting or uniform, key=lambda p: simulate(p, costs)[1] if fitting
                           else simulate(p, costs)[0])
        fixed = [none_plan(n), best_uniform, sqrt_plan(n), selective_plan(costs)]
    for p in fixed:
        peak, time = simulate(p, costs)
        rows.append({"strategy": p.name, "peak": peak, "time": time,
                     "overhead": overhead(time, none_time), "peak_ratio": peak / none_peak,
                     "fits": budget is None or peak <= budget, "plan": p.describe()})
    return rows


