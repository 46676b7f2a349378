"""The solver against a brute-force oracle on small chains, and the simulator's invariants."""

import ast
import random
import subprocess
import sys
from functools import cache

import pytest

from rematlab.exceptions import ConfigError, InfeasibleBudgetError
from rematlab.plans.fixed import uniform_plan
from rematlab.plans.plan import ChainCosts, Option, Plan, Segment, Selective
from rematlab.plans.simulate import need, simulate
from rematlab.plans.solver import solve


def random_costs(n: int, seed: int) -> ChainCosts:
    rng = random.Random(seed)
    return ChainCosts(
        x=[rng.randint(1, 6) for _ in range(n + 1)],
        saved=[rng.randint(0, 5) for _ in range(n)],
        keeps_input=[rng.random() < 0.7 for _ in range(n)],
        keeps_output=[rng.random() < 0.5 for _ in range(n)],
        fwd_mem=[rng.randint(1, 6) for _ in range(n)],
        bwd_mem=[rng.randint(1, 8) for _ in range(n)],
        grad=[rng.randint(0, 3) for _ in range(n)],
        fwd_time=[rng.randint(1, 9) * 1.0 for _ in range(n)],
        bwd_time=[rng.randint(1, 9) * 1.0 for _ in range(n)],
        base=rng.randint(0, 10),
        optimizer_peak=0,
    )


def all_plans(start: int, end: int, costs: ChainCosts | None = None) -> list[tuple]:
    """Every item sequence over blocks start..end-1, nested segments included (a segment may
    cover its whole range, but not be the only item of a segment of the same range), and
    every block kept at the top level under each option of its menu in `costs`."""

    @cache
    def seqs(s: int, t: int, whole: bool, top: bool) -> tuple[tuple, ...]:
        if s == t:
            return ((),)
        menu = costs.menu(s) if costs and top else []
        kept = [s, *(Selective.of(s, o) for o in menu)]
        out = [(k, *rest) for k in kept for rest in seqs(s + 1, t, True, top)]
        for k in range(s + 1, t + 1 if whole else t):
            for inner in seqs(s, k, False, False):
                seg = Segment(s, k, inner)
                out.extend((seg, *rest) for rest in seqs(k, t, True, top))
        return tuple(out)

    return list(seqs(start, end, True, True))


@pytest.mark.parametrize("seed", range(12))
def test_solver_is_optimal_against_brute_force(seed):
    n = 3 + seed % 3  # 3..5 blocks
    costs = random_costs(n, seed)
    candidates = [(simulate(Plan(n, items), costs), items) for items in all_plans(0, n)]
    floor = min(peak for (peak, _), _ in candidates)
    solution = solve(costs, unit=1)
    assert solution.min_peak == floor
    top = max(peak for (peak, _), _ in candidates)
    for budget in range(floor, top + 1):
        best = min(t for (peak, t), _ in candidates if peak <= budget)
        plan = solution.plan_for(budget)
        assert plan.predicted_peak <= budget
        assert plan.predicted_time == pytest.approx(best)
        assert simulate(plan, costs) == (plan.predicted_peak, plan.predicted_time)


def with_menus(costs: ChainCosts, seed: int) -> ChainCosts:
    """Up to two op-level options per block: less held, a larger backward, more time."""
    rng = random.Random(seed)
    costs.options = [[Option(f"o{j}", (("aten.mm.default", j),), rng.randint(0, costs.saved[i]),
                             rng.random() < 0.8, rng.random() < 0.3, costs.fwd_mem[i],
                             costs.bwd_mem[i] + rng.randint(0, 4), costs.fwd_time[i],
                             costs.bwd_time[i] + rng.randint(0, 4), sequence=f"b{i}")
                      for j in range(rng.randint(1, 2))] for i in range(costs.n)]
    return costs


@pytest.mark.parametrize("seed", range(8))
def test_solver_is_optimal_over_op_level_menus_against_brute_force(seed):
    """One option per kept block, chosen with the segments: optimal over every plan the
    menus allow, and each simulated exactly as the solver predicted."""
    n = 3 + seed % 2
    costs = with_menus(random_costs(n, seed), seed)
    candidates = [(simulate(Plan(n, items), costs), items)
                  for items in all_plans(0, n, costs)]
    assert any(isinstance(it, Selective) for _, items in candidates for it in items)
    solution = solve(costs, unit=1)
    assert solution.min_peak == min(peak for (peak, _), _ in candidates)
    for budget in range(solution.min_peak, max(p for (p, _), _ in candidates) + 1):
        best = min(t for (peak, t), _ in candidates if peak <= budget)
        plan = solution.plan_for(budget)
        assert plan.predicted_time == pytest.approx(best)
        assert simulate(plan, costs) == (plan.predicted_peak, plan.predicted_time)
        assert Plan.from_json(plan.to_json()).items == plan.items


def test_infeasible_budget_carries_the_minimum_peak():
    costs = random_costs(5, 99)
    solution = solve(costs, unit=1)
    with pytest.raises(InfeasibleBudgetError) as info:
        solution.plan_for(solution.min_peak - 1)
    assert info.value.min_peak == solution.min_peak
    assert isinstance(info.value, ValueError)
    assert "is infeasible: the smallest peak" in str(info.value)


def test_coarse_units_never_break_the_budget():
    costs = random_costs(12, 5)
    costs.x = [v * 1000 + 17 for v in costs.x]
    costs.saved = [v * 1000 + 3 for v in costs.saved]
    solution = solve(costs, levels=50)
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        full = simulate(Plan(12, tuple(range(12))), costs)[0]
        budget = int(solution.min_peak + frac * (full - solution.min_peak))
        plan = solution.plan_for(budget)
        assert simulate(plan, costs)[0] <= budget


def test_unconstrained_budget_gives_no_checkpointing():
    costs = random_costs(6, 3)
    full, t_full = simulate(Plan(6, tuple(range(6))), costs)
    plan = solve(costs, unit=1).plan_for(full)
    assert plan.segments == [] and plan.predicted_time == t_full


def test_checkpointing_trades_time_for_memory_in_the_simulator():
    costs = random_costs(8, 4)
    costs.saved = [50] * 8
    none = simulate(Plan(8, tuple(range(8))), costs)
    ck = simulate(uniform_plan(8, 3), costs)
    assert ck[0] < none[0] and ck[1] > none[1]
    assert need((), 8, True, costs) == (0, 0.0)


def test_solver_and_plan_modules_do_not_import_torch():
    code = ("import sys; import rematlab.plans.solver, rematlab.plans; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", _no_package_init(code)], capture_output=True,
                         text=True, check=True).stdout
    assert ast.literal_eval(out.strip()) == []


def _no_package_init(code: str) -> str:
    """Load the modules without running rematlab/__init__ (which imports torch)."""
    return (
        "import importlib.util, sys, types\n"
        "spec = importlib.util.find_spec('rematlab')\n"
        "pkg = types.ModuleType('rematlab')\n"
        "pkg.__path__ = list(spec.submodule_search_locations)\n"
        "sys.modules['rematlab'] = pkg\n" + code
    )


def test_costs_that_admit_no_plan_are_a_clear_error_not_an_index_error():
    costs = random_costs(3, seed=1)
    costs.fwd_time[1] = float("nan")  # a broken profile: no plan has a finite time
    with pytest.raises(ConfigError, match="admit no plan"):
        solve(costs).plan_for(10**6)


def paged_costs(n: int, seed: int, page: int = 4096) -> ChainCosts:
    """Heterogeneous costs in whole pages: `solve(costs, unit=page)` is exact, a reference."""
    c = random_costs(n, seed)
    rng = random.Random(seed)
    for name in ("x", "saved", "fwd_mem", "bwd_mem", "grad"):
        setattr(c, name, [(v * 31 + rng.randint(0, 30)) * page for v in getattr(c, name)])
    c.fwd_time = [rng.uniform(1, 9) for _ in range(n)]
    c.bwd_time = [rng.uniform(1, 9) for _ in range(n)]
    return c


@pytest.mark.parametrize(("n", "seed", "levels"), [(24, 0, 800), (32, 1, 400)])
def test_discretised_plans_are_within_half_a_percent_of_the_optimum(n, seed, levels):
    """The documented accuracy (solver docstring): a coarse grid's plan for budget B is
    within 0.5 % of the time of the exact optimum for 0.995 B, its floor within 0.5 %."""
    costs = paged_costs(n, seed)
    exact = solve(costs, unit=4096)
    coarse = solve(costs, levels=levels)
    assert coarse.unit > 4096  # the unit does not divide the terms: rounding is exercised
    assert coarse.min_peak <= 1.005 * exact.min_peak
    full = simulate(Plan(n, tuple(range(n))), costs)[0]
    for budget in range(coarse.min_peak, full + 1, max(1, (full - coarse.min_peak) // 100)):
        plan = coarse.plan_for(budget)
        assert plan.predicted_peak <= budget
        try:
            best = exact.plan_for(int(0.995 * budget)).predicted_time
        except InfeasibleBudgetError:
            continue
        assert plan.predicted_time <= 1.005 * best


def test_identical_blocks_share_sub_chains_and_keep_the_plans_of_distinct_ones():
    """Sub-chains are interned by their blocks' costs: an embedding, 40 identical layers and
    a head give O(n) distinct sub-chains, and the plans equal those of the same chain with
    each layer's time perturbed by a nanosecond (every sub-chain distinct): same curve."""
    layer = random_costs(1, 7)
    ends = random_costs(2, 8)
    n = 42

    def chain(shift: float) -> ChainCosts:
        c = random_costs(n, 0)
        for name in ("saved", "keeps_input", "keeps_output", "fwd_mem", "bwd_mem", "grad",
                     "fwd_time", "bwd_time"):
            values = getattr(layer, name) * (n - 2)
            if name == "fwd_time":  # distinct floats that equal the shared ones to the DP
                values = [v + shift * i for i, v in enumerate(values)]
            setattr(c, name, [getattr(ends, name)[0], *values, getattr(ends, name)[1]])
        c.x = [ends.x[0], *[layer.x[0]] * (n - 1), ends.x[1]]
        return c

    shared, distinct = solve(chain(0.0), unit=1), solve(chain(1e-9), unit=1)
    assert int(shared.ids.max()) < 4 * n < int(distinct.ids.max())
    assert ([(p.predicted_peak, round(p.predicted_time, 5)) for p in shared.frontier]
            == [(p.predicted_peak, round(p.predicted_time, 5)) for p in distinct.frontier])


def test_an_option_inside_a_checkpointed_segment_is_refused():
    costs = with_menus(random_costs(3, 0), 0)
    option = Selective.of(1, costs.menu(1)[0])
    assert Plan(3, (0, option, 2)).items[1] == option
    with pytest.raises(ConfigError, match="inside a checkpointed segment"):
        Plan(3, (Segment(0, 2, (0, option)), 2))
