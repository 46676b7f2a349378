"""Per-rank costs: a chain's costs, profiled on the unsharded model for one rank's micro-batch,
turned into what one rank of a layout holds, so that the simulator and the solver offer plans
for the rank's step. They pick the candidates; the rank's step run under each
(`engine.RankEngine`) is what verifies them, so these terms are FSDP2's and DDP's mechanisms,
not a fit:

FSDP2 (`fully_shard`, world size N):
- parameters, optimizer state and kept gradients are 1/N each (dim 0 padded to a multiple of N);
- the root's parameters are gathered from its forward to the end of its backward (FSDP2 does
  not reshard the root after forward);
- a unit's gathered parameters live through its forward (all of them, all step, without
  `reshard_after_forward`); in its backward, with the previous unit's, prefetched;
- a unit's backward also holds its unsharded gradients and the reduce-scatter input they are
  copied into, both full size in the reduce dtype.

DDP: every parameter, gradient and state whole, plus the reducer's buckets, one more copy of
every gradient (`gradient_as_bucket_view=False`, torch's default).
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from rematlab.core.layout import DDP, FSDP
from rematlab.distributed.shard import DTYPES
from rematlab.plans.plan import ChainCosts


def shard_bytes(param: nn.Parameter, world: int, itemsize: int | None = None) -> int:
    """One rank's shard of `param`: dim 0 padded up to a multiple of `world`, split."""
    size = itemsize or param.element_size()
    if param.dim() == 0:
        return size
    rows = -(-param.shape[0] // world)
    return rows * (param.numel() // max(1, param.shape[0])) * size


def per_rank(costs: ChainCosts, groups: list[list[nn.Parameter]], block_units: list[int | None],
             layout: FSDP | DDP, world: int, scale: float = 1.0) -> ChainCosts:
    """`costs` for one rank (module docstring). `groups`: each FSDP unit's parameters, then
    the root's; `block_units[i]`: the unit block i runs (None: the root's code); `scale`:
    the parameters' bytes over those of the model profiled (2 for fp32 parameters profiled
    in a bf16 `param_dtype`: their state and kept gradients are the parameters' dtype)."""
    params = [p for g in groups for p in g]
    trainable = [p for p in params if p.requires_grad]
    whole = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.numel() * p.element_size() for p in trainable)
    if scale != 1.0:  # the profile's parameters, gradients and state at the parameters' dtype
        params_more, grads_more = (round(b * (1 - 1 / scale)) for b in (whole, grads))
        state_more = round(costs.state * (scale - 1))
        costs = replace(costs, base=costs.base + params_more + state_more
                        + (grads_more if costs.grads_resident else 0),
                        state=costs.state + state_more, grad=[round(g * scale) for g in costs.grad],
                        optimizer_peak=costs.optimizer_peak + params_more + grads_more
                        + state_more)
    if isinstance(layout, DDP):
        return replace(costs, base=costs.base + grads,
                       optimizer_peak=costs.optimizer_peak + grads)
    gather = DTYPES[layout.param_dtype].itemsize if layout.param_dtype else None
    reduce = DTYPES[layout.reduce_dtype].itemsize if layout.reduce_dtype else None
    gathered = [sum(p.numel() * (gather or p.element_size()) for p in g) for g in groups]
    full_grads = [sum(p.numel() * (reduce or p.element_size()) for p in g if p.requires_grad)
                  for g in groups]
    sharded = sum(shard_bytes(p, world) for p in params)
    ratio = sum(shard_bytes(p, world) for p in trainable) / grads if grads else 0.0
    state = round(costs.state * ratio)
    live = [gathered[u] if u is not None else 0 for u in block_units]
    base = costs.base - whole - costs.state + sharded + state + gathered[-1]
    if costs.grads_resident:
        base -= grads - round(grads * ratio)
    if not layout.reshard_after_forward:
        base += sum(gathered[:-1])
        live = [0] * len(live)
    backward = [live[i] + (full_grads[u] if u is not None else 0)
                for i, u in enumerate(block_units)]
    # a block's options run its unit's gathered parameters as the block does
    options = [[replace(o, fwd_mem=o.fwd_mem + live[i], bwd_mem=o.bwd_mem + backward[i])
                for o in costs.menu(i)] for i in range(costs.n)]
    return replace(
        costs, base=base, state=state, options=options,
        grad=[round(g * ratio) for g in costs.grad],
        fwd_mem=[m + g for m, g in zip(costs.fwd_mem, live, strict=True)],
        rec_mem=[m + g for m, g in zip(costs.rec_mem, live, strict=True)] if costs.rec_mem
        else [],
        bwd_mem=[m + b for m, b in zip(costs.bwd_mem, backward, strict=True)],
        optimizer_peak=costs.optimizer_peak - whole - grads - costs.state + sharded + state
        + round(grads * ratio))
