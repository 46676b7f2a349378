"""Plans for models that run their own layer loop, under torch.compile (issue 25): the plan
is profiled and verified compiled, and `torch.compile(apply(model, plan))` trains with the
compiled plain model's gradients."""

from dataclasses import replace

import pytest
import torch

import rematlab
from rematlab.core.batch import call
from rematlab.core.steps import default_loss
from rematlab.remat.block import compiling
from tests import realzoo


def _grads(run, model, batch) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    default_loss(call(run, batch), batch).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama"])  # GPT-2 too: benchmarks/compiled_layers.py
def test_a_compiled_per_layer_plan_keeps_its_budget_and_the_compiled_gradients(name):
    torch._dynamo.reset()
    model, batch = getattr(realzoo, name)(batch=8, seq=128, layers=2)
    model.train()
    for m in model.modules():  # dropout off: compiled and eager draw different masks
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    planning = rematlab.prepare(model, batch, compile=True, fractions=())  # layer plans only
    unconstrained = planning.choose(planning.full * 2)
    assert not unconstrained.segments
    chosen = planning.choose(unconstrained.measured_peak - 1)  # below the compiled plain step
    assert chosen.compiled and chosen.segments  # at least one layer checkpointed
    assert chosen.measured_peak <= chosen.budget  # the compiled step's peak, measured
    budgeted = replace(chosen, fraction=0.5, compile_settings=None)  # torch.compile's too
    with compiling():  # past dynamo's recompile limit the model would silently run eager
        want = _grads(torch.compile(model), model, batch)
        for plan in (chosen, budgeted):
            torch._dynamo.reset()  # a planned copy's own graph (`remat.compiled_budget`)
            got = _grads(torch.compile(rematlab.apply(model, plan)), model, batch)
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_compiled_op_level_options_of_a_layer_loop_keep_the_compiled_gradients():
    """Llama's layers under op-level options made from the compiled trace (issue 38): each
    layer under its first option compiled gives the compiled plain model's gradients, and a
    plan chosen below the compiled plain step keeps its budget on the compiled step."""
    from rematlab.plans.plan import Plan, Selective

    torch._dynamo.reset()
    model, batch = realzoo.llama(batch=4, seq=64, layers=2)
    model.train()
    planning = rematlab.prepare(model, batch, compile=True, ops=True, fractions=())
    menus = planning.costs.options
    assert all(menus[1:-1])  # every layer has a compiled option
    assert all(name.startswith("aten.") for name, _ in menus[1][0].saves)
    n = planning.costs.n
    optioned = Plan(n, (0, *(Selective.of(i, menus[i][0]) for i in range(1, n - 1)), n - 1),
                    compiled=True)
    with compiling():
        want = _grads(torch.compile(model), model, batch)
        torch._dynamo.reset()
        got = _grads(torch.compile(rematlab.apply(model, optioned)), model, batch)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    plain = planning.compiled.peak(replace(optioned, items=tuple(range(n))))
    chosen = planning.choose(plain - 1)
    assert chosen.measured_peak <= plain - 1
