"""Real models plan, apply and measure without wrappers (issue 12): Hugging Face models with
dict batches and labels, a ResNet with in-place ReLU, a U-Net, a model with several inputs."""

import pytest
import torch

import rematlab
from rematlab.core.batch import call, detached
from rematlab.core.steps import default_loss
from rematlab.exceptions import ConfigError, InfeasibleBudgetError
from rematlab.remat.find import find_layers
from rematlab.remat.layers import remat_of
from tests import realzoo
from tests.meters import own_loop_peak


def _grads(model, batch, seed: int = 1) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks for both runs
    default_loss(call(model, batch), batch).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _double(batch):
    if isinstance(batch, torch.Tensor):
        return batch.double() if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {k: _double(v) for k, v in batch.items()}
    return type(batch)(_double(v) for v in batch)


@pytest.mark.parametrize("name", sorted(realzoo.MODELS))
@pytest.mark.parametrize("strategy", ["every:1", "plan"])
def test_float64_gradients_equal_the_plain_model_with_dropout_replayed(name, strategy):
    model, batch = realzoo.MODELS[name]()
    model, batch = model.double().train(), _double(batch)
    if strategy == "plan":  # the floor plan: the most recomputation the planner allows
        planning = rematlab.prepare(model, batch, optimizer=None)
        with pytest.raises(InfeasibleBudgetError) as err:
            planning.choose(1)
        strategy = planning.choose(err.value.min_peak)
        assert strategy.segments, "the floor plan checkpoints something"
    remat = rematlab.apply(model, strategy, example_input=batch)
    assert type(remat) is type(model)
    assert list(remat.state_dict()) == list(model.state_dict())
    want, got = _grads(model, batch), _grads(remat, batch)
    assert len(want) == len(got) == len([p for p in model.parameters() if p.requires_grad])
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b) or (a - b).abs().max().item() <= 1e-12
    assert remat_of(remat).recompute.segments > 0


@pytest.mark.parametrize("name", sorted(realzoo.MODELS))
def test_plans_keep_their_budget_in_the_models_own_loop_and_the_floor_is_a_budget(name):
    model, batch = realzoo.MODELS[name](batch=8)
    model.train()
    planning = rematlab.prepare(model, batch)  # profiled once, then any budget
    with pytest.raises(InfeasibleBudgetError) as err:
        planning.choose(1)
    floor = err.value.min_peak
    full = planning.choose("100GiB").measured_peak
    assert floor < full
    floor_plan = planning.choose(floor)  # the floor is a budget
    assert floor_plan.measured_peak <= floor
    for fraction in (0.0, 0.3, 0.7):
        budget = int(floor + fraction * (full - floor))
        chosen = planning.choose(budget)
        assert chosen.measured_peak <= budget
        remat = rematlab.apply(model, chosen, example_input=batch)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        assert own_loop_peak(remat, batch) <= budget
        model.load_state_dict(state)


@pytest.mark.parametrize("name", ["gpt2", "bert", "unet"])
def test_simulated_peak_is_within_3_percent_of_the_measured_one(name):
    model, batch = realzoo.MODELS[name](batch=8)
    model.train()
    planning = rematlab.prepare(model, batch)
    with pytest.raises(InfeasibleBudgetError) as err:
        planning.choose(1)
    full = planning.choose("100GiB").measured_peak
    for budget in (err.value.min_peak, (err.value.min_peak + full) // 2, full):
        chosen = planning.choose(budget)
        error = (chosen.predicted_peak - chosen.measured_peak) / chosen.measured_peak
        assert -0.01 <= error <= 0.03, (chosen.describe(), error)


def test_the_repeated_layers_are_found_by_class_or_by_name():
    gpt, _ = realzoo.gpt2()
    assert [n for n, _ in find_layers(gpt)] == [f"transformer.h.{i}" for i in range(4)]
    assert [n for n, _ in find_layers(gpt, "transformer.h")] == \
        [f"transformer.h.{i}" for i in range(4)]
    bert, _ = realzoo.bert()
    assert len(find_layers(bert)) == 4
    with pytest.raises(ConfigError, match=r"no submodule 'transformer\.nope'"):
        find_layers(gpt, "transformer.nope")


def test_a_model_returned_by_apply_keeps_its_api_and_leaves_the_original_plain():
    model, batch = realzoo.gpt2()
    model.train()
    remat = rematlab.apply(model, "every:1", example_input=batch)
    assert remat.config is model.config and hasattr(remat, "generate")
    out = call(remat, batch)
    out.loss.backward()
    assert remat_of(remat).recompute.segments == 4  # each layer recomputed once in backward
    assert remat.transformer.h[0] is model.transformer.h[0]  # shared layers, shared weights
    call(model, detached(batch)).loss.backward()  # the original runs without checkpoints
    assert remat_of(remat).recompute.segments == 4


def test_segments_of_several_layers_are_refused_for_a_model_that_runs_its_own_loop():
    model, batch = realzoo.gpt2()
    with pytest.raises(ConfigError, match="own layer loop"):
        rematlab.apply(model, "uniform:2", example_input=batch)


@pytest.mark.parametrize("name", ["gpt2", "resnet"])
def test_copies_and_pickles_of_an_applied_model_run_their_own_weights(name, tmp_path):
    import copy

    model, batch = realzoo.MODELS[name]()
    model = model.double().train()
    batch = _double(batch)
    remat = rematlab.apply(model, "every:1", example_input=batch)
    twin = copy.deepcopy(remat)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)  # the copy's weights only
    want = _grads(twin, batch)
    assert remat_of(twin).recompute.segments > 0  # the copy recomputed its own layers
    assert not any(torch.equal(a, b) for a, b in zip(_grads(remat, batch), want, strict=True))
    torch.save(twin, tmp_path / "m.pt")
    back = torch.load(tmp_path / "m.pt", weights_only=False)
    for a, b in zip(_grads(back, batch), want, strict=True):
        assert (a - b).abs().max().item() <= 1e-12
