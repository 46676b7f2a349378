import warnings

import pytest
import torch
import torch.nn.functional as F

import rematlab
from rematlab.core.recipe import Step
from rematlab.exceptions import InfeasibleBudgetError
from rematlab.measurement import zoo
from rematlab.planning.auto import AutoRemat, auto
from rematlab.planning.planner import plan, prepare
from rematlab.plans.fixed import none_plan, uniform_plan
from rematlab.plans.plan import Plan
from rematlab.plans.simulate import simulate
from rematlab.plans.solver import solve
from rematlab.remat.chain import profile_chain
from rematlab.remat.profiling import Profiling
from rematlab.remat.tracing import find_chain
from tests import userzoo
from tests.meters import own_loop_peak


def _budgets(model, x, fractions):
    planning = prepare(model, x)
    # the floor the planner reports: the model's, or the floor plan's measured peak if higher
    floor = max(planning.floor, planning.measure(planning.solution.plan_for(planning.floor)))
    full = planning.full
    return planning, floor, full, [int(floor + f * (full - floor)) for f in fractions]


@pytest.mark.parametrize(("name", "batch"), [("mlp5", 256), ("lenet5", 128),
                                              pytest.param("vgg16", 16, marks=pytest.mark.slow),
                                              pytest.param("alexnet", 32,
                                                           marks=pytest.mark.slow)])
def test_plan_honours_the_budget_on_measurement(name, batch):
    model, shape, _ = zoo.resolve(name, "cifar" if name in ("vgg16", "alexnet") else None)
    x = torch.randn(batch, *shape)
    planning, floor, full, budgets = _budgets(model, x, [0.0, 0.3, 0.7])
    assert floor <= full
    for budget in budgets:
        chosen = planning.choose(budget)  # profiled once, as `plan` does per call
        assert chosen.measured_peak is not None and chosen.predicted_peak <= budget
        # an independent meter: torch's MemTracker around a plain training loop
        assert own_loop_peak(rematlab.apply(model, chosen), x) <= budget


@pytest.mark.parametrize(("name", "batch"), [pytest.param("vgg16", 32, marks=pytest.mark.slow),
                                              ("lenet5", 256)])
def test_simulated_peak_matches_the_measured_step_within_a_percent(name, batch, tmp_path):
    model, shape, _ = zoo.resolve(name, "cifar" if name == "vgg16" else None)
    x = torch.randn(batch, *shape)
    planning, *_, budgets = _budgets(model, x, [0.2, 0.6])
    for budget in budgets:
        chosen = planning.choose(budget)
        path = tmp_path / "plan.json"
        path.write_text(chosen.to_json())
        obs = rematlab.measure(rematlab.Spec(model=name, batch=batch, strategy=f"plan:{path}",
                                             repeats=1, input="cifar" if name == "vgg16"
                                             else None))
        assert obs.outcome == "ok"
        assert obs.peak <= budget
        assert abs(chosen.predicted_peak - obs.peak) / obs.peak < 0.01


def test_infeasible_budget_raises_with_the_minimum_peak():
    model = zoo.mlp(5, width=64)
    x = torch.randn(64, 1, 28, 28)
    planning = rematlab.prepare(model, x)
    with pytest.raises(InfeasibleBudgetError) as info:
        planning.choose("1KiB")
    assert info.value.min_peak > 1024
    chosen = planning.choose(info.value.min_peak)  # the floor is itself a budget
    assert own_loop_peak(rematlab.apply(model, chosen), x) <= info.value.min_peak


def _wide_loss(out, batch):
    """A loss that saves eight outputs' worth (`pow` keeps the repeated tensor)."""
    return (out.repeat(1, 8) ** 2).mean()


@pytest.mark.parametrize("loss_fn", [None, _wide_loss])
def test_a_chains_loss_is_measured_not_assumed(loss_fn):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(256, 256),
                                                      torch.nn.ReLU()) for _ in range(6)))
    x = torch.randn(256, 256)
    planning = prepare(model, x, loss_fn=loss_fn, optimizer=None)
    full = planning.full
    for budget in (planning.floor, (planning.floor + full) // 2, full):
        chosen = planning.solution.plan_for(budget)
        measured = planning.measure(chosen)
        assert abs(chosen.predicted_peak - measured) <= 0.01 * measured, chosen.describe()


def test_planned_model_trains_with_the_same_gradients():
    model = zoo.mlp(7, width=64).double()
    x = torch.randn(256, 1, 28, 28, dtype=torch.float64)
    y = torch.randint(0, 10, (256,))
    costs = profile_chain(list(model), x, Profiling(Step(optimizer=None), repeats=1))
    chosen = solve(costs).plan_for(solve(costs).min_peak)
    assert chosen.segments
    F.cross_entropy(model(x), y).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    F.cross_entropy(rematlab.apply(model, chosen)(x), y).backward()
    for p, w in zip(model.parameters(), want, strict=True):
        assert (p.grad - w).abs().max() <= 1e-12


def test_verification_leaves_the_model_untouched():
    model = torch.nn.Sequential(
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU()),
        torch.nn.Sequential(torch.nn.Linear(8, 3)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(16, 8)
    rng = torch.get_rng_state()
    prepare(model, x).measure(none_plan(2))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())


def test_fx_cuts_a_residual_network_into_a_chain():
    model = userzoo.resnet_like()
    x = torch.randn(4, 8)
    info = find_chain(model, x)
    assert info.method == "fx" and len(info.blocks) == 6  # stem, relu, 3 residuals, head
    out = x
    for block in info.blocks:
        out = block(out)
    assert torch.allclose(out, model(x))
    remat = rematlab.apply(model, "every:1", blocks=info.blocks)
    assert torch.allclose(remat(x), model(x))


def test_long_skips_give_fewer_larger_blocks():
    info = find_chain(userzoo.unet_like(), torch.randn(2, 8))
    sizes = [len([n for n in b.graph.nodes if n.op not in ("placeholder", "output")])
             for b in info.blocks]
    assert len(info.blocks) == 4 and max(sizes) == 4  # b, relu, c, add stay together


def test_untraceable_model_falls_back_to_children_and_says_so():
    model = userzoo.Untraceable()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = find_chain(model, torch.randn(2, 8))
    assert info.method == "children" and len(info.blocks) == 3
    assert any("tracing failed" in str(w.message) for w in caught)


def test_auto_replans_per_input_shape_and_caches():
    model = zoo.mlp(5, width=128)
    wrapped = auto(model, "64MiB", optimizer=None)
    assert isinstance(wrapped, AutoRemat)
    for batch in (32, 64, 32):
        x = torch.randn(batch, 1, 28, 28)
        F.cross_entropy(wrapped(x), torch.randint(0, 10, (batch,))).backward()
    assert len(wrapped.plans) == 2
    wrapped.eval()
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(wrapped(x), model(x))  # evaluation runs the model itself
    assert len(wrapped.plans) == 2


def test_plan_json_round_trips_with_its_predictions():
    model = zoo.lenet5()
    chosen = plan(model, torch.randn(8, 1, 32, 32), "64MiB", predict=True)
    again = Plan.from_json(chosen.to_json())
    assert again == chosen and again.predicted_peak is not None


def test_fx_cuts_a_transformer_between_residual_sums():
    model = userzoo.TinyTransformer().double()
    x = torch.randn(4, 5, 16, dtype=torch.float64)
    info = find_chain(model, x)
    assert info.method == "fx" and len(info.blocks) >= 4  # 2 residual sums per layer, head
    out = x
    for block in info.blocks:
        out = block(out)
    assert torch.allclose(out, model(x))
    y = torch.randint(0, 3, (4,))
    F.cross_entropy(model(x), y).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    F.cross_entropy(rematlab.apply(model, "every:1", blocks=info.blocks)(x), y).backward()
    for p, w in zip(model.parameters(), want, strict=True):
        assert (p.grad - w).abs().max() <= 1e-12


@pytest.mark.slow
def test_plan_for_torch_compile_honours_the_budget_on_the_compiled_step(tmp_path):
    model, shape, _ = zoo.resolve("lenet5", None)
    x = torch.randn(256, *shape)
    planning = prepare(model, x, compile=True)
    budget = int(planning.floor + 0.3 * (planning.full - planning.floor))
    chosen = planning.choose(budget)
    assert chosen.compiled and chosen.measured_peak <= budget
    assert planning.measure(chosen) == chosen.measured_peak  # the compiled step
    path = tmp_path / "plan.json"
    path.write_text(chosen.to_json())
    assert Plan.from_json(path.read_text()).compiled
    remat = torch.compile(rematlab.apply(model, chosen))
    F.cross_entropy(remat(x), torch.randint(0, 10, (256,))).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_compare_lists_the_fixed_strategies_with_their_simulated_costs():
    planning = prepare(zoo.vgg16("cifar"), torch.randn(16, 3, 32, 32), verify=False)
    n, costs = planning.costs.n, planning.costs
    rows = {r.strategy: r for r in planning.baselines(None)}
    assert {"none", "sqrt", "selective"} <= set(rows)
    none_peak, none_time = simulate(none_plan(n), costs)
    assert rows["none"].peak == none_peak and rows["none"].overhead == 0.0
    for r in rows.values():
        assert r.peak_ratio == pytest.approx(r.peak / none_peak)
        assert r.overhead == pytest.approx(r.time / none_time - 1.0)
        assert r.fits
    # with a budget, the uniform row is the fastest uniform count that fits it
    budget = int(0.5 * (planning.floor + none_peak))
    uniform = next(r for r in planning.baselines(budget) if r.strategy.startswith("uniform"))
    fitting = [simulate(uniform_plan(n, k), costs) for k in range(2, n + 1)]
    assert uniform.time == min(t for p, t in fitting if p <= budget)
    assert uniform.fits


class _Scaled(torch.nn.Module):
    """Same repr, parameters and shapes for every `power`; a different computation."""

    def __init__(self, power: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)
        self.power = power

    def forward(self, x):
        for _ in range(self.power):
            x = self.lin(x)
        return torch.relu(x)


def test_identical_blocks_are_profiled_once_and_hidden_differences_are_not():
    """Repeated blocks share one profile (equal costs, times included: the solver then
    solves their sub-chains once); a block whose repr matches but whose forward does more
    work (caught by its FLOPs) is profiled on its own."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU()) for _ in range(4)]
    blocks += [_Scaled(1), _Scaled(1), _Scaled(3)]
    costs = profile_chain(blocks, torch.randn(16, 32), Profiling(Step(optimizer=None), repeats=1))
    row = [(costs.saved[i], costs.fwd_time[i], costs.bwd_time[i], costs.fwd_flops[i])
           for i in range(costs.n)]
    assert row[1] == row[2] == row[3]  # block 0's input needs no gradient: a different key
    assert row[4] == row[5] != row[6]
    assert costs.fwd_flops[6] == 3 * costs.fwd_flops[5]  # three matmuls, not one
    assert int(solve(costs).ids.max()) < costs.n * (costs.n + 1) // 2


@pytest.mark.parametrize("text", ["0 1 2 3", "0 [1-1]{1} [2-2]{2} 3",
                                  "[0-2]{0,1,2} [3-4]{[3-3]{3},4} 5",
                                  "0 1{save addmm×4, bmm×2} [2-3]{2,3} @ fraction 0.5"])
def test_a_described_plan_parses_back(text):
    """Fact files name the plans they measured by `describe()` (issue 49)."""
    from rematlab.plans.text import parse_plan

    n = 6 if text.startswith("[0-2]") else 4
    assert parse_plan(text, n).describe() == text


@pytest.mark.parametrize("text", ["0 1 3", "0 [1-2{1,2} 3", "x", "0 1 2 3 @ fraction 2"])
def test_a_bad_plan_description_is_one_config_error(text):
    from rematlab.exceptions import ConfigError
    from rematlab.plans.text import parse_plan

    with pytest.raises(ConfigError, match=r"plan"):
        parse_plan(text, 4)
