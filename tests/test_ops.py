"""Op-level plans (issue 27): blocks kept under an option that saves some ops' outputs and
recomputes the rest. Exact gradients with dropout replayed and BatchNorm updated once,
budgets under torch's MemTracker, and plans for other code refused."""

from dataclasses import replace

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import rematlab
from rematlab.core.batch import call
from rematlab.core.clocks import WallClock
from rematlab.core.recipe import Step
from rematlab.core.steps import default_loss
from rematlab.exceptions import ConfigError
from rematlab.plans.plan import Plan, Selective
from rematlab.plans.solver import solve
from rematlab.remat.layers import remat_of
from rematlab.remat.ops import describe_saves, profile_ops, save_sets
from tests import realzoo
from tests.grads import assert_grads_match, step_grads
from tests.meters import own_loop_peak
from tests.test_real_models import _double, _grads


def _every_option(planning: rematlab.Planning) -> Plan:
    """Every block with a menu kept under one of its op-level (dispatch-mode) options, the
    options taken in turn."""
    c = planning.costs
    menus = [[o for o in c.menu(i) if o.saves] for i in range(c.n)]
    return Plan(c.n, tuple(Selective.of(i, menus[i][i % len(menus[i])]) if menus[i] else i
                           for i in range(c.n)))


def _selective(plan: Plan) -> list[Selective]:
    return [it for it in plan.items if isinstance(it, Selective)]


@pytest.mark.parametrize("name", ["gpt2", "resnet"])
def test_float64_gradients_and_buffers_equal_the_plain_model_under_op_level_plans(name):
    model, batch = realzoo.MODELS[name]()
    model, batch = model.double().train(), _double(batch)
    planning = rematlab.prepare(model, batch, optimizer=None, ops=True)
    menus = [[o.name for o in planning.costs.menu(i)] for i in range(planning.costs.n)]
    assert all(len(set(names)) == len(names) for names in menus)  # plans name options
    plan = _every_option(planning)
    assert len(_selective(plan)) >= 2
    remat = rematlab.apply(model, plan, example_input=batch)
    buffers = [b.clone() for b in model.buffers()]
    want = _grads(model, batch)  # dropout masks seeded alike for both runs
    after_plain = [b.clone() for b in model.buffers()]
    for b, saved in zip(model.buffers(), buffers, strict=True):
        b.copy_(saved)
    got = _grads(remat, batch)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b) or (a - b).abs().max().item() <= 1e-12
    for a, b in zip(after_plain, model.buffers(), strict=True):
        assert torch.equal(a, b)  # running statistics updated once, not again in recompute
    assert remat_of(remat).recompute.segments >= len(_selective(plan))


@pytest.mark.parametrize("name", ["gpt2", "resnet"])
def test_op_level_plans_keep_their_budget_under_torchs_memtracker(name):
    """Options are given their block's plain times, so that the choice goes by memory alone
    and takes them (on this CPU, tiny layers pay more for the dispatch mode than they save):
    the budget must hold whatever the times."""
    model, batch = realzoo.MODELS[name](batch=8)
    model.train()
    planning = rematlab.prepare(model, batch, ops=True)
    c = planning.costs
    c.options = [[replace(o, fwd_time=c.fwd_time[i], bwd_time=c.bwd_time[i]) for o in c.menu(i)]
                 for i in range(c.n)]
    planning.solution = solve(c, layers=planning.structure.kind == "layers")
    full = planning.choose("100GiB").measured_peak
    for fraction in (0.5, 0.3, 0.7, 0.15):
        budget = int(planning.floor + fraction * (full - planning.floor))
        plan = planning.choose(budget)
        if _selective(plan):
            break
    assert _selective(plan), "some budget takes an op-level option"
    assert plan.measured_peak <= budget
    remat = rematlab.apply(model, plan, example_input=batch)
    assert own_loop_peak(remat, batch) <= budget


def test_a_plan_made_for_other_code_is_refused_and_the_right_code_runs_it():
    model, batch = realzoo.gpt2()
    plan = Plan.from_json(_every_option(rematlab.prepare(model, batch, ops=True)).to_json())
    assert _selective(plan) and all(it.saves and it.sequence for it in _selective(plan))
    loss = default_loss(call(rematlab.apply(model, plan), batch), batch)
    loss.backward()
    cfg = GPT2Config(**{**model.config.to_dict(), "activation_function": "relu"})
    other = GPT2LMHeadModel(cfg).train()  # same shapes and parameters, other ops
    with pytest.raises(ConfigError, match="plan is stale: layer 0 ran"):
        call(rematlab.apply(other, plan), batch)


def test_a_plan_whose_saves_name_ops_its_block_never_runs_is_refused(tmp_path):
    """The fingerprint of the block's ops still matches an edited plan; its saves do not."""
    import json

    model, batch = realzoo.gpt2()
    plan = _every_option(rematlab.prepare(model, batch, ops=True))
    data = json.loads(plan.to_json())
    for item in data["items"]:
        if isinstance(item, dict) and "option" in item:  # aten.addmm -> aten.mm, and so on
            item["saves"] = [[name.replace("addmm", "mm").replace("bmm", "baddbmm"), k]
                             for name, k in item["saves"]]
            item["saves"].append(["aten.mm.default", 999])  # an occurrence beyond the last
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="saves ops layer 0 does not run"):
        call(rematlab.apply(model, Plan.from_json(edited.read_text())), batch)


def test_menus_name_the_policies_users_know_and_never_save_random_or_mutated_outputs():
    model, _ = realzoo.gpt2(layers=1)
    layer = model.transformer.h[0].train()
    x = torch.randn(4, 32, 64, requires_grad=True).clone()
    ops = profile_ops(layer, layer, x, repeats=1)
    assert {o.name for o in ops if o.random} == {"aten.bernoulli_.float"}  # dropout masks
    sets = save_sets(ops)
    names = [describe_saves(s) for s in sets]
    assert names[0] == "save addmm×4, bmm×2"  # every matmul's output ("save matmuls")
    assert "softmax" not in names[1] and "bmm" not in names[1]  # Megatron's attention core
    bad = {(o.name, o.index) for o in ops if o.random or o.inplace or o.view}
    assert bad and not any(bad & set(s) for s in sets)


class _StepTimes:
    """A timer whose side-by-side run reports fixed step times (seconds by candidate)."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds
        self.ran: list[str] = []

    def run(self, work: dict, repeats: int, warmup: int = 1):
        for name, one in work.items():  # each candidate's step really runs
            one(WallClock())
            self.ran.append(name)
        return self

    def median(self, name: str) -> float:
        return self.seconds[name]


@pytest.mark.parametrize(("measured", "scale"), [(2.5, 2.5), (0.01, 1.0)])
def test_options_are_priced_at_what_a_step_under_them_measures_never_less(
        monkeypatch, measured, scale):
    """The step with every layer under its first option and the step with every layer kept
    run side by side; each option's time beyond its plain layer is scaled by the measured
    extra over the profiled one (2.5x here), and never scaled down."""
    from rematlab.remat import layer_costs
    from rematlab.remat.block import BlockCost

    model, batch = realzoo.gpt2(layers=2)
    model.train()
    planning = rematlab.prepare(model, batch, ops=True)
    layers = planning.structure.blocks
    rows = [BlockCost(x=0, saved=0, keeps_input=False, keeps_output=False, fwd_mem=0,
                      rec_mem=0, bwd_mem=0, grad=0, fwd_time=planning.costs.fwd_time[i],
                      bwd_time=planning.costs.bwd_time[i], fwd_flops=0.0, cast=0, params=0,
                      out=torch.empty(0), options=planning.costs.menu(i)) for i in (1, 2)]
    profiled = sum(r.options[0].fwd_time + r.options[0].bwd_time - r.fwd_time - r.bwd_time
                   for r in rows)
    timer = _StepTimes({"kept": 1.0, "options": 1.0 + measured * profiled})
    monkeypatch.setattr(layer_costs, "profile_timer", lambda _device: timer)
    got, kept = layer_costs._options_in_step(model, batch, layers, rows, Step())
    assert timer.ran == ["kept", "options"]
    assert kept == 1.0  # the all-kept step's time, the profile's step time (timed once)
    for row, new in zip(rows, got, strict=True):
        plain = row.fwd_time + row.bwd_time
        for o, n in zip(row.options, new.options, strict=True):
            assert n.fwd_time == o.fwd_time and n.saved == o.saved
            assert n.fwd_time + n.bwd_time - plain == pytest.approx(
                scale * (o.fwd_time + o.bwd_time - plain))


def test_an_op_level_profile_times_the_all_kept_step_once(monkeypatch):
    """With op-level menus the all-kept step is timed side by side with the all-option step,
    and that is the profile's step time: the outer costs do not time it again."""
    from rematlab.remat import outer

    timed_by_outer = []
    real = outer.step_time
    monkeypatch.setattr(outer, "step_time",
                        lambda *a: timed_by_outer.append(a[-1]) or real(*a))
    model, batch = realzoo.gpt2(layers=2)
    planning = rematlab.prepare(model.train(), batch, ops=True)
    assert timed_by_outer == [0]  # outer_costs ran with no timed repeat
    assert planning.costs.bwd_time[0] >= 0.0 and sum(planning.costs.fwd_time) > 0


@pytest.mark.slow
def test_under_bf16_autocast_a_module_option_keeps_its_measured_peak_in_the_users_loop():
    """Issue 50: under bf16 autocast GPT-2's tanh GELU is offered as a module to recompute
    (no dispatch mode, no per-op host work). A plan that runs every layer under it gives its
    tensors back, the peak the planner measures for it holds in the user's own autocast loop,
    and its gradients are the plain autocast model's. (Whether the solver prefers it to the
    op-level options at a given budget is a matter of timing: `benchmarks/`, not here.)"""
    from tests.meters import user_loop_peak

    torch.manual_seed(0)
    model, batch = realzoo.gpt2(batch=4, seq=128, layers=4, width=128)
    model.train()
    step = Step(precision="bf16", optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-4})
    planning = rematlab.prepare(model, batch, step=step, ops=True)
    c = planning.costs
    acts = {i: next(o for o in c.menu(i) if o.modules) for i in range(c.n) if c.menu(i)}
    assert acts and all(o.modules == ("mlp.act",) and not o.saves for o in acts.values())
    assert all(o.saved < c.saved[i] for i, o in acts.items())  # the GELU's tensors given back
    plan = Plan(c.n, tuple(Selective.of(i, acts[i]) if i in acts else i for i in range(c.n)))
    measured = planning.measure(plan)
    assert measured < planning.measure(Plan(c.n, tuple(range(c.n))))
    planned = rematlab.apply(model, Plan.from_json(plan.to_json()))  # read back, as saved
    peak = user_loop_peak(planned, batch, precision="bf16",
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    assert peak <= measured, (plan.describe(), peak, measured)

    torch.manual_seed(1)  # one seed each: the plain model and the planned one draw one mask
    want = step_grads(model, batch, "bf16")
    torch.manual_seed(1)
    assert_grads_match(step_grads(planned, batch, "bf16", params=model.parameters()), want,
                       "bf16")
    assert "forward" not in model.transformer.h[0].mlp.act.__dict__  # put back after


def _module_option_plan(model: torch.nn.Module, batch: dict) -> Plan:
    """Every layer of `model` kept under its module-level option (its activation recomputed)."""
    c = rematlab.prepare(model, batch, optimizer=None, ops=True).costs
    acts = {i: o for i in range(c.n) for o in c.menu(i) if o.modules}
    assert acts, "the menu offers a module-level option"
    return Plan(c.n, tuple(Selective.of(i, acts[i]) if i in acts else i for i in range(c.n)))


@pytest.mark.parametrize(("edit", "says"), [
    (lambda it: it.update(sequence="0" * 16), "plan is stale: layer 0 ran"),
    (lambda it: it.update(modules=["attn"]),
     "recomputes 'attn' in layer 0, which is not among its activation modules .mlp.act."),
    (lambda it: it.update(modules=["mlp.act", "mlp.act"]), "names 'mlp.act' twice in layer 0"),
])
def test_an_edited_module_level_option_is_refused_and_the_plan_as_made_runs(edit, says):
    """Issue 64: a hand-edited module-level option (its op sequence's hash, another submodule,
    one named twice) is one clean error; the file as it was made runs and gives the plain
    model's gradients."""
    import json

    model, batch = realzoo.gpt2()
    model.train()
    data = json.loads(_module_option_plan(model, batch).to_json())
    planned = rematlab.apply(model, Plan.from_json(json.dumps(data)))
    torch.manual_seed(1)
    want = step_grads(model, batch, "fp32")
    torch.manual_seed(1)
    assert_grads_match(step_grads(planned, batch, "fp32", params=model.parameters()), want,
                       "fp32")
    for item in data["items"]:
        if isinstance(item, dict) and item.get("modules"):
            edit(item)
    with pytest.raises(ConfigError, match=says):
        call(rematlab.apply(model, Plan.from_json(json.dumps(data))), batch)


def test_a_module_level_plan_for_a_gelu_model_is_refused_on_a_relu_one():
    """The same submodule names, other ops: the option's op sequence no longer matches."""
    model, batch = realzoo.gpt2()
    plan = _module_option_plan(model.train(), batch)
    cfg = GPT2Config(**{**model.config.to_dict(), "activation_function": "relu"})
    other = GPT2LMHeadModel(cfg).train()
    with pytest.raises(ConfigError, match=r"plan is stale: layer 0 ran .* \(recompute mlp.act"):
        call(rematlab.apply(other, plan), batch)


def test_a_layer_plan_for_a_narrower_model_is_refused_with_the_layer_and_parameter():
    model, batch = realzoo.gpt2()
    plan = Plan.from_json(rematlab.prepare(model, batch, optimizer=None)
                          .choose("1GiB").to_json())
    assert rematlab.apply(model, plan) is not None  # its own model takes it
    wider, _ = realzoo.gpt2(width=128)
    with pytest.raises(ConfigError, match=r"layer 0's ln_1\.weight is 128, the plan's was 64"):
        rematlab.apply(wider, plan)
