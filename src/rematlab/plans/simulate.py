"""The memory and time simulator of plans (`rematlab.plans.plan`): the model the solver
optimises, over per-block cost arrays (`ChainCosts`); no torch.

A block run plainly *holds* its saved tensors until its backward; the tensor at a boundary
between blocks is counted once; a checkpointed segment holds its input and is recomputed
during backward (the design note in `rematlab.plans.plan`).
"""

from __future__ import annotations

from rematlab.exceptions import ConfigError
from rematlab.plans.offload import unprefetched
from rematlab.plans.plan import ChainCosts, Item, Option, Plan, Selective


def need(items: tuple[Item, ...], end: int, held_in: bool, c: ChainCosts) -> tuple[int, float]:
    """Memory (above the baseline, with the gradient of `x[end]` counted in it) and time that
    the items need to run forward and backward over `..end-1`; `held_in` says whether the input
    of the first item is already held by someone else."""
    if not items:
        return 0, 0.0
    first, rest = items[0], items[1:]
    if isinstance(first, (int, Selective)):
        s, opt = kept(first, c)
        held, fwd, bwd = keep_terms(c, s, end, held_in, opt)
        m_rest, t_rest = need(rest, end, opt.keeps_output if opt else c.keeps_output[s], c)
        step = opt.fwd_time + opt.bwd_time if opt else c.fwd_time[s] + c.bwd_time[s]
        return max(fwd, held + m_rest, bwd), step + t_rest
    s, k = first.start, first.end
    held, fwd, recompute_base = checkpoint_terms(c, s, k, end, held_in)
    m_rest, t_rest = need(rest, end, False, c)
    m_in, t_in = need(first.inner, k, True, c)
    mem = max(fwd, held + m_rest, recompute_base + m_in)
    return mem, sum(c.fwd_time[s:k]) + c.checkpoint_cost(s) + t_rest + t_in


def kept(item: int | Selective, c: ChainCosts) -> tuple[int, Option | None]:
    """A kept item's block and its option (None: the block run plainly)."""
    if isinstance(item, int):
        return item, None
    return item.block, c.option(item.block, item.option)


def keep_terms(c: ChainCosts, s: int, end: int, held_in: bool, opt: Option | None = None
               ) -> tuple[int, int, int]:
    """Block s run kept (plainly, or under option `opt`), with `..end` to backpropagate:
    what it holds until its backward, its forward peak and its backward peak (relative, as
    in `need`). The one place these formulas live: the simulator (`need`) and the solver
    both call it."""
    saved, ki, ko, fwd_mem, bwd_mem = ((opt.saved, opt.keeps_input, opt.keeps_output,
                                        opt.fwd_mem, opt.bwd_mem) if opt else
                                       (c.saved[s], c.keeps_input[s], c.keeps_output[s],
                                        c.fwd_mem[s], c.bwd_mem[s]))
    if end == s + 1 < c.n and not opt and c.rec_mem:  # it ends a recomputed segment
        fwd_mem = c.rec_mem[s]
    held = saved + (c.x[s] if ki and not held_in else 0) + (c.x[s + 1] if ko else 0)
    fwd = (0 if held_in else c.x[s]) + fwd_mem
    if s == c.n - 1:  # the chain's last block is always kept: the loss runs after it
        fwd = max(fwd, held + c.loss_mem)
    bwd = held + c.x[s + 1] - c.x[end] + c.grads_between(s + 1, end) + bwd_mem
    return held, fwd, bwd


def checkpoint_terms(c: ChainCosts, s: int, k: int, end: int, held_in: bool
                     ) -> tuple[int, int, int]:
    """Segment [s, k) checkpointed, with `..end` to backpropagate: what it holds (its input),
    the peak of its forward run without saving, and the memory already live when backward
    recomputes it (its input, the output gradient, the gradients of later blocks)."""
    held = 0 if held_in else c.x[s]
    fwd = held + max(c.fwd_mem[i] + (c.x[i] if i > s else 0) for i in range(s, k))
    recompute_base = held + c.x[k] - c.x[end] + c.grads_between(k, end)
    return held, fwd, recompute_base


def held_bytes(plan: Plan, c: ChainCosts) -> int:
    """What a plan holds for backward when its forward ends: kept blocks' saved tensors and
    boundaries, checkpointed segments' inputs (the terms of `need`)."""
    total, held_in = 0, True
    for item in plan.items:
        if isinstance(item, (int, Selective)):
            s, opt = kept(item, c)
            total += keep_terms(c, s, c.n, held_in, opt)[0]
            held_in = opt.keeps_output if opt else c.keeps_output[s]
        else:
            total += checkpoint_terms(c, item.start, item.end, c.n, held_in)[0]
            held_in = False
    return total


def simulate(plan: Plan, costs: ChainCosts) -> tuple[int, float]:
    """Peak bytes of the whole training step and its time (seconds) under `plan`."""
    if plan.n_blocks != costs.n:
        raise ConfigError(f"plan is for {plan.n_blocks} blocks, the chain has {costs.n}")
    return items_cost(plan.items, costs)


def items_cost(items: tuple[Item, ...], costs: ChainCosts) -> tuple[int, float]:
    """`simulate` for a plan's top-level items (what the solver's frontier reads)."""
    mem, time = need(items, costs.n, True, costs)
    return (step_peak(costs, max(mem, cached_forward(items, costs))),
            time + unprefetched(items, costs))


def cached_forward(items: tuple[Item, ...], c: ChainCosts) -> int:
    """The forward's peak with autocast's weight cache counted (relative, as in `need`): a
    checkpointed segment holds its input *and* its blocks' cached casts until the forward
    ends, when the autocast region exits and the cache is cleared, before backward (so
    `need`, which covers backward, leaves the cache out). 0 without autocast."""
    if not c.cast:
        return 0
    held, cache, peak, held_in = 0, 0, 0, True
    for item in items:
        if isinstance(item, (int, Selective)):
            s, opt = kept(item, c)
            h, fwd, _ = keep_terms(c, s, c.n, held_in, opt)
            peak = max(peak, held + cache + fwd)
            held += h
            held_in = opt.keeps_output if opt else c.keeps_output[s]
            continue
        s, k = item.start, item.end
        h = 0 if held_in else c.x[s]
        peak = max(peak, held + cache + h + max(
            c.fwd_mem[i] + (c.x[i] if i > s else 0) + c.cached(s, i) for i in range(s, k)))
        held += h
        cache += c.cached(s, k)
        held_in = False
    return peak


def step_peak(costs: ChainCosts, mem: int) -> int:
    """The whole step's peak for a plan whose forward+backward needs `mem` bytes above the
    baseline: the larger of that and the optimizer step's own peak."""
    return max(costs.base + mem, costs.optimizer_peak)


def overhead(time: float, none_time: float) -> float:
    """Time overhead of a plan against keeping every activation: `time / none - 1`."""
    return time / none_time - 1.0 if none_time > 0 else 0.0
