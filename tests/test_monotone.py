"""A larger budget never buys a slower plan (issue 25): the planner walks its frontier
fastest first and takes the first plan whose *measured* peak fits, so a plan the simulation
underestimates costs the next-best plan, never the floor."""

import dataclasses
import itertools

import pytest
import torch
from torch import nn

import rematlab
from tests import realzoo
from tests.meters import own_loop_peak


def _chain() -> tuple[nn.Module, torch.Tensor]:
    layers = [nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.Tanh())
              for _ in range(6)]
    return nn.Sequential(*layers, nn.Linear(64, 10)), torch.randn(512, 64)


CASES = {"chain": _chain, "qwen2": lambda: realzoo.qwen2(batch=8, seq=32, layers=6),
         "gpt2": lambda: realzoo.gpt2(batch=8, seq=32, layers=4)}


def _floor_budget(planning) -> int:
    try:
        return planning.choose(planning.floor).measured_peak
    except rematlab.InfeasibleBudgetError as exc:
        return exc.min_peak


@pytest.mark.parametrize("name", sorted(CASES))
def test_time_never_grows_with_the_budget_and_every_measured_peak_fits(name):
    model, batch = CASES[name]()
    planning = rematlab.prepare(model.train(), batch)
    floor = _floor_budget(planning)
    top = max(planning.full, planning.choose(planning.full * 2).measured_peak)
    plans = [planning.choose(int(floor + i * (top - floor) / 9)) for i in range(10)]
    times = [p.predicted_time for p in plans]
    assert all(a >= b for a, b in itertools.pairwise(times)), times
    assert all(p.measured_peak <= p.budget for p in plans)
    assert times[0] > times[-1]  # the sweep spans real choices, from checkpointing to none


def test_the_choice_does_not_depend_on_which_budgets_were_asked_before():
    model, batch = realzoo.qwen2(batch=8, seq=32, layers=6)
    ascending = rematlab.prepare(model.train(), batch)
    budgets = [int(ascending.floor + f * (ascending.full - ascending.floor) * 1.1)
               for f in (0.1, 0.4, 0.7, 1.0)]
    up = [ascending.choose(b).describe() for b in budgets]
    descending = dataclasses.replace(ascending, _measured={})  # the same profile, no memory
    down = [descending.choose(b).describe() for b in reversed(budgets)]
    assert up == list(reversed(down))


def test_a_transformer_encoder_is_planned_through_its_layers_without_naming_them():
    model, x = realzoo.encoder(batch=16, seq=32)
    planning = rematlab.prepare(model.train(), x)
    assert planning.structure.kind == "layers"
    assert planning.structure.names[0] == "enc.layers.0" and len(planning.structure.blocks) == 6
    assert "inside" in planning.structure.describe()
    plan = planning.choose(planning.floor * 1.02)
    assert plan.measured_peak <= 0.4 * planning.full
    remat = rematlab.apply(model, plan)
    assert type(remat) is type(model)
    assert own_loop_peak(remat, x) <= plan.budget


def test_prepare_serves_many_budgets_from_one_profile_and_a_curve():
    model, x = _chain()
    planning = rematlab.prepare(model.train(), x)
    curve = planning.curve()
    assert curve[0]["peak"] == planning.floor and curve[-1]["overhead"] == 0.0
    assert planning.unconstrained.describe() == curve[-1]["plan"]
    # the curve is the Pareto front: every fixed strategy, simulated on the same costs, is
    # matched or beaten in both peak and time by one of its points
    for row in planning.baselines():
        assert any(c["peak"] <= row.peak and c["time"] <= row.time * (1 + 1e-9)
                   for c in curve), row
