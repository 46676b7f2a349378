"""Every stack of a model is planned (issue 39): encoder-decoders whose encoder and decoder
layers are different classes (BART, Marian, Whisper), T5's two stacks of one class, and a
user's own encoder-decoder that transformers knows nothing of. Peaks are read by the
live-storage tracker in the user's own loop: MemTracker refuses frozen parameters
(Marian's and Whisper's sinusoidal positions), and where it runs, its module hooks keep
the encoder's output alive once more per checkpointed decoder layer (BART: 128 KiB above
the same loop unobserved, seen by nesting both meters), so it reads the loop it observes,
not the user's."""

import pytest
import torch

import rematlab
from rematlab.core.batch import call
from rematlab.core.steps import default_loss
from rematlab.exceptions import InfeasibleBudgetError
from rematlab.remat.find import find_layers
from rematlab.remat.layers import remat_of
from tests import stackzoo
from tests.meters import own_loop_peak

STACKS = {"bart": ["model.encoder.layers", "model.decoder.layers"],
          "marian": ["model.encoder.layers", "model.decoder.layers"],
          "whisper": ["model.encoder.layers", "model.decoder.layers"],
          "t5": ["encoder.block", "decoder.block"],
          "own": ["encoder", "decoder"]}


def _floor(planning) -> int:
    with pytest.raises(InfeasibleBudgetError) as err:
        planning.choose(1)
    return err.value.min_peak


def _every_layer(name: str, model) -> torch.nn.Module:
    """The ecosystem's own tool, each layer checkpointed: transformers'
    `activation_checkpointing_enable()`, or torch's checkpoint around each layer of the
    user's model (rematlab's "every:1")."""
    twin, batch = stackzoo.MODELS[name]()
    twin.load_state_dict(model.state_dict())
    twin.train()
    if hasattr(twin, "activation_checkpointing_enable"):
        twin.activation_checkpointing_enable()  # transformers 5's gradient_checkpointing_enable
        return twin
    return rematlab.apply(twin, "every:1", example_input=batch)


@pytest.mark.parametrize("name", sorted(stackzoo.MODELS))
def test_every_stack_is_found_and_named(name):
    model, batch = stackzoo.MODELS[name]()
    names = [n for n, _ in find_layers(model)]
    assert [n.rpartition(".")[0] for n in names] == [s for s in STACKS[name] for _ in range(3)]
    described = rematlab.prepare(model, batch, optimizer=None).structure.describe()
    for stack in STACKS[name]:
        assert f"{stack} x3" in described


@pytest.mark.parametrize("name", sorted(stackzoo.MODELS))
def test_the_floor_reaches_every_layer_checkpointed_and_plans_keep_their_budget(name):
    torch.manual_seed(0)
    model, batch = stackzoo.MODELS[name]()
    model.train()
    planning = rematlab.prepare(model, batch)
    floor = _floor(planning)
    full = planning.choose("100GiB").measured_peak
    ecosystem = own_loop_peak(_every_layer(name, model), batch, meter="live")
    for budget in (floor, (floor + full) // 2):
        chosen = planning.choose(budget)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        peak = own_loop_peak(rematlab.apply(model, chosen, example_input=batch), batch,
                             meter="live")
        model.load_state_dict(state)
        assert peak <= budget, (chosen.describe(), peak, budget)
        if budget == floor:
            # checkpointing both stacks: the floor is what every layer checkpointed reaches
            assert peak <= ecosystem, (chosen.describe(), peak, ecosystem)
            names = [n for n, _ in find_layers(model)]
            recomputed = {i for s in chosen.segments for i in range(s.start, s.end)}
            assert {names[i - 1].rpartition(".")[0] for i in recomputed} == set(STACKS[name])


@pytest.mark.parametrize("name", sorted(stackzoo.MODELS))
def test_float64_gradients_of_the_floor_plan_equal_the_plain_model(name):
    model, batch = stackzoo.MODELS[name]()
    model = model.double().train()
    batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()} \
        if isinstance(batch, dict) else tuple(t.double() for t in batch)
    planning = rematlab.prepare(model, batch, optimizer=None)
    remat = rematlab.apply(model, planning.choose(_floor(planning)), example_input=batch)

    def grads(m):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same dropout masks
        default_loss(call(m, batch), batch).backward()
        return [p.grad.clone() for p in m.parameters() if p.grad is not None]

    want, got = grads(model), grads(remat)
    assert len(want) == len(got) == len([p for p in model.parameters() if p.requires_grad])
    for a, b in zip(want, got, strict=True):
        assert (a - b).abs().max().item() <= 1e-12
    assert remat_of(remat).recompute.segments >= 4  # layers of both stacks recomputed
