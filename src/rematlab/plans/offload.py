"""Offload as a third choice per layer, priced: a layer kept whose saved activations wait in
host memory between its forward and its backward (`rematlab.remat.offload` runs it). No torch.

An offload option is an `Option` named "offload" (every saved tensor worth moving) or
"offload N" (those the layer saves first, up to N bytes: `caps`), with `host` bytes moved.
On a PCIe link a layer's forward hides only part of its activations' copies, so the capped
options are what pays there; on a Grace Hopper link, all of it. "offload input" is the layer
checkpointed with its input in host memory (transformers' `offload=True`, torchtune's
offloading under activation checkpointing): it holds nothing on the device, so it lowers the
floor. The solver takes each like an op-level option (a kept block holding less), so keep,
recompute and offload are chosen together, per layer, against the whole step's peak. What the
mechanism does decides the terms, each measured or derived here:

- **Device bytes.** What the layer holds once its copies are done (`saved`) is metered on a
  run of the layer under the offloader (`rematlab.remat.offload_costs`), host buffers counted
  apart. Its copies may read the device tensors until the *next* layer's forward ends, when
  the compute stream waits for them: during that forward the layer holds `host` bytes more
  (`fwd_mem` covers it). In backward its tensors come back (its metered `bwd_mem`), and the
  previous layer's start coming back a layer ahead, so its backward also holds the previous
  layer's offloaded bytes (counted whether or not that layer is offloaded: an upper bound).
- **Seconds.** Device-to-host copies overlap the next layer's forward, host-to-device ones
  the next layer's backward (the prefetch), each at the target's measured link rate in its
  direction; what a window cannot hide is paid (`exposed`). The two directions never run at
  once here (forward copies out, backward copies in), so they do not share the link. Only a
  next layer that is offloaded too prefetches (its backward starts the reload); otherwise a
  layer reloads in its own backward, unhidden. The solver, which sees one layer at a time,
  takes every reload as prefetched; the simulator adds what no prefetch hid
  (`unprefetched`), as it adds autocast's casts, after the solver's recursion. Where that
  makes a plan slower than one without offload, the frontier has the other: the chain is
  solved without offload too, and the two frontiers are merged (`plans.solver.solve`), so
  offload never makes a budget's plan slower.
- **Host memory.** The pinned pool holds each offloaded layer's bytes until its backward;
  only the first layers whose bytes fit in `Link.host` are offered offload, so no plan pins
  more than the job may. Pinning is paid once per buffer size (a pool), not per step.
- Layers only: not the first pseudo-block, and not the last layer (the loss's backward needs
  it first, so it would come back at once).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rematlab.exceptions import ConfigError
from rematlab.plans.plan import (
    OFFLOAD,
    OFFLOAD_INPUT,
    ChainCosts,
    Item,
    Option,
    Selective,
    offloads,
)


@dataclass(frozen=True)
class Link:
    """The host link of a device: measured bytes per second each way, and the host bytes a
    job may pin."""

    d2h: float
    h2d: float
    host: int

    def __post_init__(self) -> None:
        for name in ("d2h", "h2d"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"a host link's {name} is a positive rate in bytes per "
                                  f"second, got {value!r}")
        if isinstance(self.host, bool) or not isinstance(self.host, int) or self.host < 0:
            raise ConfigError(f"a host link's host memory is a whole number of bytes >= 0, "
                              f"got {self.host!r}")


def exposed(seconds: float, window: float) -> float:
    """What of a copy of `seconds` a window of compute of `window` seconds does not hide."""
    return max(0.0, seconds - window)


def is_offload(item: Item | None) -> bool:
    return isinstance(item, Selective) and offloads(item.option)


def offerable(c: ChainCosts) -> range:
    """The blocks that may be offloaded: the layers, the last one excepted."""
    return range(1, c.n - 2)


def caps(link: Link, fwd_time: float) -> list[int | None]:
    """The offload options a layer is metered at: what the link moves under the next
    layer's forward (taken as long as this one's), half and twice that, and everything
    (None). On a slow link only the first hide; on a fast one everything does."""
    window = link.d2h * fwd_time
    return [int(window * k) for k in (0.5, 1.0, 2.0)] + [None]


def option_name(cap: int | None) -> str:
    return OFFLOAD if cap is None else f"{OFFLOAD} {cap}"


def with_offload(c: ChainCosts, metered: list[list[Option]], link: Link) -> ChainCosts:
    """`c` with each block's offload options (`metered[i]`: their bytes as metered under the
    offloader, `host` > 0, their times the plain block's) in its menu, priced on `link`
    (module docstring); blocks beyond what the host may pin get none."""
    if len(metered) != c.n:
        raise ConfigError(f"offload costs for {len(metered)} blocks, the chain has {c.n}")
    menus = [list(c.menu(i)) for i in range(c.n)]
    most = [max((o.host for o in m), default=0) if i in offerable(c) else 0
            for i, m in enumerate(metered)]
    pinned = 0
    for s in offerable(c):
        pinned += most[s]
        if pinned > link.host:
            break
        nxt = s + 1
        # the next layer's forward, however it runs (offloaded: with its copies' staging)
        fwd_next = max([c.fwd_mem[nxt], *(c.rec_mem[nxt:nxt + 1]),
                        *(o.fwd_mem for o in (*c.menu(nxt), *metered[nxt]))])
        for raw in metered[s]:
            h2d = raw.host / link.h2d
            hidden_in = exposed(h2d, c.bwd_time[nxt])
            # checkpointed with its input offloaded: its forward runs again in backward
            again = (c.fwd_time[s] + c.checkpoint_cost(s) if raw.name == OFFLOAD_INPUT
                     else 0.0)
            menus[s].append(replace(
                raw, saves=(), modules=(),
                fwd_mem=max(raw.fwd_mem, raw.saved + c.x[s + 1] + raw.host + fwd_next),
                bwd_mem=raw.bwd_mem + most[s - 1],
                fwd_time=c.fwd_time[s] + exposed(raw.host / link.d2h, c.fwd_time[nxt]),
                bwd_time=again + c.bwd_time[s] + hidden_in, unprefetched=h2d - hidden_in))
    return replace(c, options=menus)


def serialized(c: ChainCosts, link: Link) -> ChainCosts:
    """`c`'s offload options with copies that overlap nothing (torch's `save_on_cpu`: each
    copy synchronous on the compute stream, no prefetch): a peer's price, not a choice."""
    menus = [[replace(o, fwd_time=c.fwd_time[s] + o.host / link.d2h,
                      bwd_time=o.bwd_time + o.unprefetched, unprefetched=0.0)
              if offloads(o.name) else o for o in c.menu(s)] for s in range(c.n)]
    return replace(c, options=menus)


def unprefetched(items: tuple[Item, ...], c: ChainCosts) -> float:
    """Seconds of reloads no prefetch hid: an offloaded block whose next item is not an
    offloaded block reloads in its own backward."""
    extra = 0.0
    for item, after in zip(items, (*items[1:], None), strict=True):
        if is_offload(item) and not is_offload(after):
            assert isinstance(item, Selective)
            extra += c.option(item.block, item.option).unprefetched
    return extra


def without_offload(c: ChainCosts) -> ChainCosts:
    """`c` with no offload option in any menu."""
    return replace(c, options=[[o for o in c.menu(i) if not offloads(o.name)]
                               for i in range(c.n)])


def host_bytes(items: tuple[Item, ...], c: ChainCosts) -> int:
    """The host bytes a plan's offloaded blocks hold at once (all of them, at the end of the
    forward)."""
    return sum(c.option(it.block, it.option).host for it in items
               if isinstance(it, Selective) and is_offload(it))
