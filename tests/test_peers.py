"""The peers' own checkpointing as fixed plans (issue 59): torchtitan's full, layer and op
selective AC and transformers' `every_n_layers`, each the plan its project runs, so that a
published run of it is priced like for like (`rematlab.plans.fixed.peer_plan`)."""

import pytest
import torch

import rematlab
from rematlab.exceptions import ConfigError
from rematlab.plans.fixed import TORCHTITAN_OP, peer_plan
from rematlab.plans.plan import Segment, Selective
from tests import realzoo
from tests.test_real_models import _double, _grads


def _checkpointed_layers(plan) -> list[int]:
    """The layers (from 0) a per-layer plan checkpoints whole."""
    return [it.start - 1 for it in plan.items if isinstance(it, Segment)]


def _planning(ops: bool = False, layers: int = 5):
    model, batch = realzoo.llama(layers=layers)
    return model, batch, rematlab.prepare(model, batch, optimizer=None, ops=ops)


def test_layer_frequencies_count_as_each_project_counts():
    """torchtitan counts its wrapped layers from 1 and checkpoints multiples of K
    (`ptd_checkpoint_wrapper._count % ac_freq == 0`); transformers checkpoints the layers
    whose index from 0 is a multiple of K (`layer_index % every_n_layers == 0`)."""
    _, _, planning = _planning()
    costs = planning.costs
    assert _checkpointed_layers(peer_plan(costs, "torchtitan:layer:2")) == [1, 3]
    assert _checkpointed_layers(peer_plan(costs, "transformers:every:2")) == [0, 2, 4]
    assert _checkpointed_layers(peer_plan(costs, "torchtitan:layer:1")) == [0, 1, 2, 3, 4]
    assert _checkpointed_layers(peer_plan(costs, "torchtitan:full")) == [0, 1, 2, 3, 4]
    assert _checkpointed_layers(peer_plan(costs, "transformers:every:3")) == [0, 3]


@pytest.mark.parametrize("name", ["torchtitan:layer:0", "torchtitan:layer:x", "deepspeed:full",
                                  "transformers:every:", "torchtitan:op"])
def test_an_unknown_peer_strategy_or_one_its_planning_cannot_run_is_refused(name):
    _, _, planning = _planning()  # no op-level menu: torchtitan:op has nothing to run
    with pytest.raises(ConfigError, match=r"peer strategy|ops=True"):
        peer_plan(planning.costs, name)


def test_torchtitans_op_policy_saves_every_other_mm_and_gradients_equal_the_plain_model():
    """On this CPU a Llama layer's forward runs seven `aten.mm` and the CPU flash kernel,
    which torchtitan's save list does not name: its policy saves mm 1, 3, 5 and 7 and
    recomputes the rest; float64 gradients equal the plain model's."""
    model, batch = realzoo.llama(layers=3)
    model, batch = model.double().train(), _double(batch)
    planning = rematlab.prepare(model, batch, optimizer=None, ops=True)
    plan = peer_plan(planning.costs, "torchtitan:op")
    chosen = [it for it in plan.items if isinstance(it, Selective)]
    assert len(chosen) == 3 and all(it.option == TORCHTITAN_OP for it in chosen)
    assert chosen[0].saves == tuple(("aten.mm.default", i) for i in (0, 2, 4, 6))
    want = _grads(model, batch)
    got = _grads(rematlab.apply(model, plan, example_input=batch), batch)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b) or (a - b).abs().max().item() <= 1e-12
