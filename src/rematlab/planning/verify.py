"""Measured peaks of planned steps: what the planner verifies a plan by, on the device, with
the one step-peak probe (`rematlab.core.probes.peak_of`), and the table of fixed strategies
a plan is shown against."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
from rematlab.remat.structure import Structure


@dataclass(frozen=True)
class PlannedStep:
    """A plan installed for measuring: `run` is what the user's step calls (compiled when
    the plan is: `torch.compile(apply(model, plan))`), `owner` holds the parameters and
    buffers, `eager` runs the same blocks keeping everything, uncompiled (the reference a
    compiled candidate is timed against), `batch` is what `run` takes."""

    owner: nn.Module
    run: Callable
    eager: Callable
    batch: object
    compiled: bool


def planned_step(st: Structure, model: nn.Module, chosen: Plan, batch: object) -> PlannedStep:
    """`chosen` on `model`'s blocks: a `RematChain` over a chain's blocks (on its one input
    tensor), or installed on the layers of a model that runs its own loop."""
    if st.kind == "layers":
        twin = attach(model, LayerRemat(st.blocks, chosen))
        return PlannedStep(model, compiled(twin) if chosen.compiled else twin, model, batch,
                           chosen.compiled)
    remat = RematChain(st.blocks, chosen)
    return PlannedStep(remat, compiled(remat) if chosen.compiled else remat,
                       RematChain(st.blocks, none_plan(len(st.blocks))), batch,
                       chosen.compiled)


def measure_planned(planned: PlannedStep, costs: ChainCosts, step: Step) -> int:
    """The measured peak of the user's step (`Step.backward_passes`; `step_peak`) through
    `planned`; compiled, after a step that compiles forward and backward outside the
    measurement (dynamo's recompile limit lifted)."""
    with compiling():
        if planned.compiled:
            with preserved(planned.owner):
                step.micro_batch(planned.run, planned.batch)
        return step_peak(planned.owner, planned.run, planned.batch, costs, step,
                         tensors_seen=not planned.compiled)


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


@dataclass(frozen=True)
class Baseline:
    """A fixed strategy on one chain, simulated: its name, peak (bytes) and time (seconds),
    its time overhead and peak over keeping everything, whether it fits the budget, and its
    plan as `Plan.describe` writes it."""

    strategy: str
    peak: int
    time: float
    overhead: float
    peak_ratio: float
    fits: bool
    plan: str


def strategy_table(costs: ChainCosts, budget: int | None = None, per_layer: bool = False
                   ) -> list[Baseline]:
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
        rows.append(Baseline(p.name, peak, time, overhead(time, none_time), peak / none_peak,
                             budget is None or peak <= budget, p.describe()))
    return rows


