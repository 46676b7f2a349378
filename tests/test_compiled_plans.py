"""Compiled plans choose among measured candidates: rematlab's compiled plan, torch.compile's
own activation memory budget (a fraction, scoped to the planned model), or both (issue 38)."""

from dataclasses import replace

import pytest
import torch
from torch import nn

import rematlab
from rematlab.exceptions import ConfigError
from rematlab.planning.planner import prepare
from rematlab.plans.fixed import none_plan
from rematlab.plans.plan import Plan
from rematlab.remat.compiled_budget import settings
from tests.meters import compiled_alone, saved_step


def _chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128),
                                         nn.Tanh()) for _ in range(4)),
                         nn.Linear(128, 10)).double()


X = torch.randn(256, 128, dtype=torch.float64)


@pytest.fixture(scope="module")
def planning():
    return prepare(_chain(), X, compile=True, fractions=(0.0, 1.0))


def test_the_choice_is_the_fastest_measured_candidate_within_the_budget(planning):
    fractions = {f: planning.compiled.peak(p) for f, p in
                 zip((0.0, 1.0), planning.compiled.fraction_plans(), strict=True)}
    assert all(peak is not None for peak in fractions.values())
    floor = planning.floor_budget()
    assert floor <= min(fractions.values())  # never above what a fraction alone reaches
    for budget in (floor, fractions[0.0], (fractions[0.0] + fractions[1.0]) // 2,
                   fractions[1.0]):
        chosen = planning.choose(budget)
        assert chosen.compiled and chosen.measured_peak <= budget
        assert chosen.compile_settings["torch"] == torch.__version__
        assert chosen.compile_settings["activation_memory_budget"] == (
            1.0 if chosen.fraction is None else chosen.fraction)
        assert planning.compiled.peak(chosen) == chosen.measured_peak


def test_a_fraction_in_a_plan_keeps_the_compiled_gradients(planning):
    model = planning.structure.blocks  # the chain's blocks, shared with the model
    owner = nn.Sequential(*model)
    plain = compiled_alone(rematlab.apply(owner, none_plan(len(model))))
    expected, saved = saved_step(owner, plain, X)
    for fraction in (0.0, 0.5):
        plan = Plan(len(model), none_plan(len(model)).items, fraction=fraction, compiled=True)
        grads, fewer = saved_step(owner, compiled_alone(rematlab.apply(owner, plan)), X)
        assert fewer < saved  # compiled under its own budget: it recomputes more
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_fraction_is_scoped_to_the_planned_model():
    """The region is entered only while dynamo traces the planned forward: the same model
    compiled without the plan keeps the global budget, and eager calls run as they are."""
    owner = _chain()
    plan = Plan(len(owner), none_plan(len(owner)).items, fraction=0.0, compiled=True)
    planned = rematlab.apply(owner, plan)
    planned(X)  # eager: no region (it would raise outside compile)
    saved = {name: saved_step(owner, compiled_alone(model), X)[1]
             for name, model in (("planned", planned), ("other", owner))}
    assert saved["planned"] < saved["other"]  # fraction 0 recomputes what 1 saves


def test_a_plan_json_made_under_one_budget_is_refused_under_another(planning, tmp_path):
    chosen = planning.choose(planning.floor_budget())
    owner = nn.Sequential(*planning.structure.blocks)
    path = tmp_path / "plan.json"
    plain = replace(chosen, fraction=None, compile_settings=settings(None))
    path.write_text(plain.to_json())
    loaded = Plan.from_json(path.read_text())
    assert loaded.compile_settings == {"torch": torch.__version__, "mode": "default",
                                       "dynamic": False, "activation_memory_budget": 1.0}
    rematlab.apply(owner, loaded)  # as measured: accepted
    with torch._functorch.config.patch(activation_memory_budget=0.5), \
            pytest.raises(ConfigError, match=r"activation_memory_budget 1\.0"):
        rematlab.apply(owner, loaded)
    own = replace(chosen, fraction=0.5, compile_settings=settings(0.5))
    path.write_text(own.to_json())
    with torch._functorch.config.patch(activation_memory_budget=0.25):  # its own region
        rematlab.apply(owner, Plan.from_json(path.read_text()))
    other = Plan.from_json(path.read_text().replace(torch.__version__, "2.0.0"))
    with pytest.raises(ConfigError, match=r"torch 2\.0\.0"):
        rematlab.apply(owner, other)
    with pytest.raises(ConfigError, match="memory budget"):
        Plan.from_json(path.read_text().replace('"fraction": 0.5', '"fraction": 2'))


def test_a_compiled_plan_is_refused_on_a_wider_model_and_applies_to_its_own(planning, tmp_path):
    """Issue 64: a plan records its blocks' parameter shapes; one saved for this chain and
    applied to a chain of the same depth but wider layers is refused, naming the block and
    the parameter, and is applied as written to its own chain."""
    saved = tmp_path / "plan.json"
    saved.write_text(planning.choose(planning.floor_budget()).to_json())
    plan = Plan.from_json(saved.read_text())
    assert plan.compiled and plan.shapes is not None
    own = nn.Sequential(*planning.structure.blocks)
    assert rematlab.apply(own, plan).plan == plan
    torch.manual_seed(0)
    wider = nn.Sequential(*(nn.Sequential(nn.Linear(128, 1024), nn.GELU(),
                                          nn.Linear(1024, 128), nn.Tanh()) for _ in range(4)),
                          nn.Linear(128, 10)).double()
    with pytest.raises(ConfigError, match=r"block 0's 0\.weight is 1024×128, the plan's was "
                                          r"512×128; plan again for this model"):
        rematlab.apply(wider, plan)
