"""The plans of the fixed strategies — none, uniform segments, every k blocks, sqrt, every layer
and selective — as `Plan`s over a chain's blocks, so that they are simulated, compared and
run exactly as the optimal plan is. No torch."""

from __future__ import annotations

import math

from rematlab.exceptions import ConfigError
from rematlab.plans.plan import ChainCosts, Item, Plan, Segment, Selective


def plain(start: int, end: int) -> tuple[Item, ...]:
    return tuple(range(start, end))


def segments_plan(n: int, bounds: list[int], name: str) -> Plan:
    """Checkpoint every segment `bounds[j]..bounds[j+1]-1` except the last, as
    `torch.utils.checkpoint.checkpoint_sequential` does (the last one would be recomputed
    immediately, so checkpointing it only costs time)."""
    items: list[Item] = []
    for j in range(len(bounds) - 1):
        a, b = bounds[j], bounds[j + 1]
        if j < len(bounds) - 2:
            items.append(Segment(a, b, plain(a, b)))
        else:
            items.extend(plain(a, b))
    return Plan(n, tuple(items), name=name)


def uniform_plan(n: int, segments: int, name: str | None = None) -> Plan:
    """`segments` near-equal segments over n blocks (at most n)."""
    k = max(1, min(segments, n))
    bounds = [round(j * n / k) for j in range(k + 1)]
    return segments_plan(n, bounds, name or f"uniform:{segments}")


def per_layer_plan(n: int, checkpointed, name: str) -> Plan:
    """Each block in `checkpointed` a segment of its own, the rest kept (a model whose own
    loop runs its layers can only checkpoint them one at a time)."""
    picked = set(checkpointed)
    return Plan(n, tuple(Segment(i, i + 1, (i,)) if i in picked else i for i in range(n)),
                name=name)


def every_layer_plan(n: int) -> Plan:
    """Every layer of a per-layer chain checkpointed (blocks 1..n-2; 0 and n-1 are what runs
    before and after the layers): transformers' gradient checkpointing, as `every:1`."""
    return per_layer_plan(n, range(1, n - 1), "every:1")


def every_plan(n: int, size: int) -> Plan:
    """Segments of `size` consecutive blocks (the last may be shorter)."""
    bounds = [*range(0, n, size), n]
    return segments_plan(n, bounds, f"every:{size}")


def sqrt_plan(n: int) -> Plan:
    """Chen et al. (2016): about sqrt(n) segments of sqrt(n) blocks."""
    return uniform_plan(n, max(1, round(math.sqrt(n))), name="sqrt")


def none_plan(n: int) -> Plan:
    return Plan(n, plain(0, n), name="none")


def _selected(costs: ChainCosts, threshold: float, among: range) -> list[bool]:
    """Blocks in `among` whose saved bytes per forward FLOP are at least `threshold` times the
    average over `among` (see `selective_plan`)."""
    stored = [costs.saved[i] + costs.x[i + 1] * costs.keeps_output[i] for i in range(costs.n)]
    flops = costs.fwd_flops or costs.fwd_time
    avg = sum(stored[i] for i in among) / max(sum(flops[i] for i in among), 1e-30)
    return [i in among and stored[i] / max(flops[i], 1e-30) >= threshold * avg
            for i in range(costs.n)]


def selective_per_layer(costs: ChainCosts, threshold: float = 1.0) -> Plan:
    """`selective` for a model running its own layer loop: the same rule over its layers
    (blocks 1..n-2 of the pseudo-block chain), each picked layer checkpointed alone."""
    pick = _selected(costs, threshold, range(1, costs.n - 1))
    return per_layer_plan(costs.n, [i for i, p in enumerate(pick) if p],
                          "selective" if threshold == 1.0 else f"selective:{threshold:g}")


def selective_plan(costs: ChainCosts, threshold: float = 1.0) -> Plan:
    """Checkpoint the blocks whose saved bytes per forward FLOP are at least `threshold` times
    the chain's average, merging neighbours into one segment; the last block is never
    checkpointed (it would be recomputed at once).

    Why bytes per FLOP: dropping a block's activations frees `saved` bytes and costs one more
    forward of the block; blocks that store much and compute little (pooling, activations,
    wide early convolutions) are the cheap memory to give back.
    """
    n = costs.n
    pick = _selected(costs, threshold, range(n))
    pick[-1] = False
    items: list[Item] = []
    i = 0
    while i < n:
        if not pick[i]:
            items.append(i)
            i += 1
            continue
        j = i
        while j < n and pick[j]:
            j += 1
        items.append(Segment(i, j, plain(i, j)))
        i = j
    return Plan(n, tuple(items), name="selective" if threshold == 1.0 else f"selective:{threshold}")


# The option torchtitan's op-level selective AC is priced as (`remat.ops.TORCHTITAN_OP_SAC`)
TORCHTITAN_OP = "torchtitan op SAC"
PEERS = ("torchtitan:full", "torchtitan:op", "torchtitan:layer:K", "transformers:every:K")


def peer_plan(costs: ChainCosts, name: str) -> Plan:
    """A peer project's own checkpointing of a per-layer chain (blocks 1..n-2 are the
    layers), so that a published run of it is priced like for like:
    - `torchtitan:full`: every layer under `checkpoint_wrapper`;
    - `torchtitan:op`: every layer kept under torchtitan's op-level selective AC (the option
      of that name: plan with `ops=True`);
    - `torchtitan:layer:K`: torchtitan's selective layer AC, whose wrapper counts the layers
      from 1 and checkpoints those whose count is a multiple of K;
    - `transformers:every:K`: `activation_checkpointing_enable(every_n_layers=K)`, which
      checkpoints the layers whose index from 0 is a multiple of K."""
    n = costs.n
    layers = range(1, n - 1)
    project, _, rest = name.partition(":")
    if name == "torchtitan:full":
        return per_layer_plan(n, layers, name)
    if name == "torchtitan:op":
        if not any(costs.options):
            raise ConfigError("torchtitan:op is an op-level policy: prepare(..., ops=True)")
        items: list[Item] = list(range(n))
        for i in layers:
            found = [o for o in costs.options[i] if o.name == TORCHTITAN_OP]
            if not found:
                raise ConfigError(f"layer {i - 1} runs no op torchtitan's op-level AC saves")
            items[i] = Selective.of(i, found[0])
        return Plan(n, tuple(items), name=name)
    mode, _, k = rest.partition(":")
    if (project, mode) in (("torchtitan", "layer"), ("transformers", "every")) \
            and k.isdigit() and int(k) >= 1:
        every = int(k)
        first = every if project == "torchtitan" else 1  # a count from 1, an index from 0
        return per_layer_plan(n, [i for i in layers if (i - first) % every == 0], name)
    raise ConfigError(f"unknown peer strategy {name[:80]!r}: choose {', '.join(PEERS)} "
                      "(K a positive integer)")
