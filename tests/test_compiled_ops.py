"""Op-level options under torch.compile (issue 38): the menu is made from the compiled trace,
options run as selective-checkpoint regions of the compiled graph, their gradients are the
compiled plain model's, the budget holds on the compiled step, and an option made for other
code is refused while the region is traced."""

import pytest
import torch
from torch import nn

import rematlab
from rematlab.planning.planner import prepare
from rematlab.plans.fixed import none_plan
from rematlab.plans.plan import Plan, Selective
from tests.meters import compiled_alone, saved_step


def _chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256),
                                         nn.Linear(256, 64), nn.Tanh()) for _ in range(2)),
                         nn.Linear(64, 10)).double()


X = torch.randn(128, 64, dtype=torch.float64)


@pytest.fixture(scope="module")
def planning():
    return prepare(_chain(), X, compile=True, ops=True, fractions=())


def test_compiled_options_keep_the_compiled_gradients(planning):
    menus = planning.costs.options
    assert menus[0] and menus[1] and not menus[2]  # the head has no op to recompute
    n = planning.costs.n
    owner = nn.Sequential(*planning.structure.blocks)
    expected, saved = saved_step(owner, compiled_alone(rematlab.apply(owner, none_plan(n))), X)
    for pick in (0, -1):  # each block's first and last option
        items = tuple(Selective.of(i, m[pick]) if m else i for i, m in enumerate(menus))
        plan = Plan(n, items, compiled=True)
        grads, fewer = saved_step(owner, compiled_alone(rematlab.apply(owner, plan)), X)
        assert fewer < saved  # the options save less than the plain compiled graph
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_the_compiled_menu_names_the_traced_ops_and_the_budget_holds(planning):
    """The options' op fingerprints are of the compiled trace; the chosen plan's compiled
    peak, measured, is within the budget at the floor and above it."""
    option = planning.costs.options[0][0]
    assert all(name.startswith("aten.") for name, _ in option.saves)
    floor = planning.floor_budget()
    full = planning.choose(planning.full * 2)
    for budget in (floor, (floor + full.measured_peak) // 2):
        chosen = planning.choose(budget)
        assert chosen.compiled and chosen.measured_peak <= budget
        assert planning.compiled.peak(chosen) == chosen.measured_peak
    assert floor < planning.compiled.peak(none_plan(planning.costs.n))


def test_an_option_made_for_other_code_is_refused_under_compile(planning):
    menus = planning.costs.options
    owner = nn.Sequential(*planning.structure.blocks)
    n = planning.costs.n
    stale = Selective(0, "stale", menus[0][0].saves, "0" * 16)
    edited = Selective(0, "edited", (("aten.addmm.default", 7),), menus[0][0].sequence)
    for item, says in ((stale, "plan is stale"), (edited, "saves ops")):
        plan = Plan(n, (item, *range(1, n)), compiled=True)
        with pytest.raises(Exception, match=says):
            compiled_alone(rematlab.apply(owner, plan))(X)


class _Wavering(nn.Module):
    """A block whose forward runs other ops on every other call (as a Python-side random
    layer drop would): no option made from one trace holds for the next."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(64, 64).double()
        self.flip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.flip = not self.flip
        y = self.inner(x)
        return torch.tanh(y) * 2 if self.flip else torch.sigmoid(y) + 1


def test_an_option_torch_compile_cannot_run_is_dropped_with_a_warning():
    torch.manual_seed(0)
    model = nn.Sequential(_Wavering(), nn.Linear(64, 10).double())
    with pytest.warns(RuntimeWarning, match="dropped from the compiled menu.*plan is stale"):
        dropped = prepare(model, X, compile=True, ops=True, fractions=())
    assert not dropped.costs.options[0]
    chosen = dropped.choose(dropped.floor_budget())  # the plan goes on without them
    assert chosen.measured_peak <= dropped.floor_budget()


@pytest.mark.slow
def test_compiled_options_around_in_place_ops_keep_the_gradients_and_buffers():
    """A ResNet (batch norm, in-place ReLU): outputs written in place are never saved, and a
    plan of compiled options gives the compiled plain model's gradients and running stats."""
    from tests import realzoo

    torch.manual_seed(0)
    model, x = realzoo.resnet(batch=8, size=16)
    model = model.double()
    x = x.double()
    planning = prepare(model, x, compile=True, ops=True, fractions=())
    menus = planning.costs.options
    assert any(menus)
    for menu in menus:
        for option in menu:
            assert not any(name.split(".")[1].endswith("_") for name, _ in option.saves)
    n = planning.costs.n
    owner = nn.Sequential(*planning.structure.blocks)
    plan = Plan(n, tuple(Selective.of(i, m[0]) if m else i for i, m in enumerate(menus)),
                compiled=True)
    results = {}
    for name, chosen in (("plain", none_plan(n)), ("options", plan)):
        start = {k: v.clone() for k, v in owner.state_dict().items()}
        owner.zero_grad(set_to_none=True)
        compiled_alone(rematlab.apply(owner, chosen))(x).square().mean().backward()
        results[name] = ([p.grad.clone() for p in owner.parameters()],
                         {k: v.clone() for k, v in owner.state_dict().items()})
        owner.load_state_dict(start)
    for got, want in zip(results["options"][0], results["plain"][0], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    for key, want in results["plain"][1].items():
        torch.testing.assert_close(results["options"][1][key], want, rtol=0, atol=1e-12)
