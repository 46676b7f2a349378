"""Shapes that change (issue 39): `rematlab.auto` profiles once per bucket of shapes, not per
shape, and a plan reused for a smaller shape keeps its budget."""

import pytest
import torch

import rematlab
from rematlab.core.batch import call, tensors
from rematlab.core.optimizers import make_optimizer
from rematlab.core.probes import LiveTensorTracker
from rematlab.core.steps import default_loss
from rematlab.exceptions import InfeasibleBudgetError
from rematlab.planning.shapes import ShapeBuckets, bucket_size, covers, tiled
from tests import realzoo


def test_buckets_round_the_dimensions_that_change_up_to_powers_of_two():
    assert [bucket_size(n) for n in (1, 2, 3, 40, 64, 65, 128)] == [1, 2, 4, 64, 64, 128, 128]
    buckets = ShapeBuckets()
    buckets.observe(((4, 57), (4, 57)))
    assert buckets.top(((4, 57), (4, 57))) == ((4, 57), (4, 57))  # nothing seen to change
    buckets.observe(((4, 90), (4, 90)))
    assert buckets.top(((4, 90), (4, 90))) == ((4, 128), (4, 128))
    assert buckets.top(((4, 41), (4, 41))) == ((4, 64), (4, 64))  # the batch stays 4
    assert covers(((4, 64),), ((4, 41),)) and not covers(((4, 64),), ((8, 41),))
    assert not covers(((4, 64),), ((4, 64), (4,)))


def test_a_tiled_batch_keeps_its_values_and_grows_cyclically():
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    grown = tiled({"input_ids": ids, "n": torch.tensor([1])}, ((2, 5), (1,)))
    assert torch.equal(grown["input_ids"], torch.tensor([[5, 6, 7, 5, 6], [8, 9, 10, 8, 9]]))
    assert torch.equal(grown["n"], torch.tensor([1]))


@pytest.mark.slow
def test_auto_over_dynamically_padded_batches_profiles_at_most_three_times_within_budget():
    torch.manual_seed(0)
    model, longest = realzoo.gpt2(seq=128)  # positions for 128 tokens
    model.train()
    planning = rematlab.prepare(model, longest)
    try:
        planning.choose(1)
    except InfeasibleBudgetError as err:
        floor = err.min_peak
    budget = (floor + planning.choose("100GiB").measured_peak) // 2
    wrapped = rematlab.auto(model, budget)
    opt = make_optimizer("momentum", model.parameters())
    batches = realzoo.padded_batches(20)
    assert len({b["input_ids"].shape for b in batches}) > 10  # a new shape almost every step
    peaks = []  # of the steps that did not plan (planning profiles the step unconstrained)
    for batch in batches:
        planned = wrapped.planned
        opt.zero_grad(set_to_none=True)
        tracker = LiveTensorTracker()
        state = [t for s in opt.state.values() for t in s.values()]
        tracker.track([*model.parameters(), *model.buffers(), *tensors(batch), *state])
        with tracker:
            out = call(wrapped, batch)
            default_loss(out, batch).backward()
            opt.step()
            del out
        if wrapped.planned == planned:
            peaks.append(tracker.peak)
    assert 2 <= wrapped.planned <= 3, [e.shapes for e in wrapped.events]
    assert all(e.peak <= budget for e in wrapped.events)
    assert len(peaks) >= 17 and max(peaks) <= budget, (max(peaks), budget)
    assert any("[" in e.plan for e in wrapped.events)  # the budget asked for checkpoints


def test_without_buckets_every_new_shape_is_planned():
    model, _ = realzoo.gpt2(seq=128)
    wrapped = rematlab.auto(model.train(), "1GiB", optimizer=None, shape_buckets=False)
    batches = realzoo.padded_batches(4, seed=1)
    for batch in batches:
        default_loss(call(wrapped, batch), batch).backward()
    assert wrapped.planned == len({b["input_ids"].shape for b in batches})


def test_a_bucket_past_the_models_positions_is_planned_at_the_batchs_own_shapes(monkeypatch):
    """GPT-2 with 100 positions: the 128-token bucket cannot be tiled; its batches are
    planned at their own lengths, and the bucket's top is not tried again."""
    from rematlab.planning.auto import AutoRemat

    model, _ = realzoo.gpt2(seq=100)
    tried = []
    prepare = AutoRemat._prepare
    monkeypatch.setattr(AutoRemat, "_prepare",
                        lambda self, ex: tried.append(ex["input_ids"].shape[1]) or
                        prepare(self, ex))
    wrapped = rematlab.auto(model.train(), "1GiB", optimizer=None)
    for length in (60, 90, 95, 80):
        ids = torch.randint(0, 97, (2, length))
        batch = {"input_ids": ids, "labels": ids}
        default_loss(call(wrapped, batch), batch).backward()
    assert tried == [60, 128, 90, 95]  # 80 reuses the plan made at 95
    assert [e.profiled[0][1] for e in wrapped.events] == [60, 90, 95]
