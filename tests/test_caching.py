"""The caching allocator's replay (`rematlab.preflight.caching`) follows
`CUDACachingAllocator.cpp`'s rules, and a predicted GPU plan is held to its budget by the
reserved peak of its whole step replayed through them (issue 40)."""

import pytest
import torch

import rematlab
from rematlab.preflight.caching import CachingAllocator
from tests import realzoo

MiB = 1 << 20


def test_small_requests_share_a_two_mib_segment_and_large_ones_a_twenty_mib_one():
    a = CachingAllocator()
    for i in range(3):
        a.alloc(("small", i), 100_000)
    assert (a.reserved, a.allocated) == (2 * MiB, 3 * 100_352)  # 512-byte blocks
    a.alloc("mid", 5 * MiB)
    a.alloc("mid2", 5 * MiB)  # the rest of the first 20 MiB segment, split off
    assert a.reserved == 22 * MiB
    a.alloc("big", 11 * MiB + 1)  # its own segment, rounded to 2 MiB
    assert a.reserved == 34 * MiB


def test_a_block_whose_rest_is_at_most_one_mib_is_handed_out_whole():
    a = CachingAllocator()
    a.alloc("w", 33 * MiB)  # a 34 MiB segment: 1 MiB left, not worth a split
    assert (a.allocated, a.reserved) == (34 * MiB, 34 * MiB)


def test_freed_blocks_are_cached_merged_and_reused_best_fit():
    a = CachingAllocator()
    a.alloc("x", 8 * MiB)
    a.alloc("y", 8 * MiB)
    a.free("x")
    a.alloc("z", 9 * MiB)  # 8 MiB and 4 MiB holes: neither fits, a new segment
    assert (a.allocated, a.reserved) == (17 * MiB, 40 * MiB)
    a.free("y")  # merges with x's hole and the 4 MiB tail: one free 20 MiB block
    a.alloc("w", 19 * MiB)
    assert a.reserved == 40 * MiB  # served from the cache
    a.alloc("v", 2 * MiB)  # the second segment's 11 MiB rest, the best fit
    assert a.reserved == 40 * MiB and a.peak_reserved == 40 * MiB


def test_a_full_card_releases_free_segments_before_it_runs_out():
    a = CachingAllocator(capacity=40 * MiB)
    a.alloc("x", 12 * MiB)
    a.free("x")  # 12 MiB cached in its own segment
    a.alloc("y", 30 * MiB)  # 12 + 30 > 40: the cached segment goes back first
    assert (a.reserved, a.fits) == (30 * MiB, True)
    a.alloc("z", 12 * MiB)
    assert not a.fits  # 42 MiB would be needed


def test_a_predicted_gpu_plan_keeps_its_reserved_peak_within_the_budget():
    model, batch = realzoo.llama(batch=4, seq=64, layers=4, width=128)
    step = rematlab.Step(precision="bf16", optimizer=torch.optim.AdamW)
    planning = rematlab.prepare(model.train(), batch, predict=True, target="h100-80gb",
                                step=step)
    floor = planning.floor_budget()
    full = planning.choose(int(planning.full * 1.1))
    card = planning.card(full)
    assert full.reserved_peak == card.reserved >= card.allocated >= full.predicted_peak
    assert card.fits and card.capacity == planning.target.usable
    # a budget the simulated peaks fit but the reserved one does not: a smaller plan
    tight = (full.predicted_peak * 101 // 100 + card.reserved) // 2
    assert floor <= tight < card.reserved
    chosen = planning.choose(tight)
    assert chosen.reserved_peak <= tight and chosen.describe() != full.describe()
    assert planning.choose(floor).reserved_peak <= floor


@pytest.mark.parametrize("step", [
    pytest.param(rematlab.Step(precision="bf16", micro_batches=2, clip=1.0,
                               optimizer=torch.optim.AdamW), id="bf16-accumulate-adamw"),
    pytest.param(rematlab.Step(output_alive="forward"), id="fp32-momentum",
                 marks=pytest.mark.slow)])
def test_the_second_steps_replayed_events_are_a_second_step_run(step, monkeypatch):
    """`reserve._again`: the second fake step's forwards and backwards are the first's
    events renamed, and only its optimizer phase runs; replayed on any card, the trace is
    exactly the one of a second step run whole (events, peaks, fits)."""
    from rematlab.planning import reserve
    from rematlab.preflight.targets import resolve_target

    model, batch = realzoo.gpt2(batch=2, seq=32, layers=3, width=64)
    planning = rematlab.prepare(model.train(), batch, predict=True, target="h100-80gb",
                                step=step, verify=False)
    plan = planning.choose(planning.floor_budget())
    cards = [resolve_target(c, "cuda") for c in ("h100-80gb", "rtx4090")]
    made = []
    again = reserve._again
    monkeypatch.setattr(reserve, "_again", lambda *args: made.append(again(*args)) or made[-1])
    renamed = reserve._trace(model, planning.structure, batch, step, plan)
    assert made and made[0] is not None  # the second step was replayed, not run
    monkeypatch.setattr(reserve, "_again", lambda *args: None)  # the second step run whole
    run = reserve._trace(model, planning.structure, batch, step, plan)
    assert (len(renamed.events), renamed.second_at) == (len(run.events), run.second_at)
    assert [e[1] for e in renamed.events] == [e[1] for e in run.events]  # sizes, in order
    assert [renamed.replayed(c) for c in cards] == [run.replayed(c) for c in cards]
