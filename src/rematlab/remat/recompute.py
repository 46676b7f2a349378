"""What every checkpointed region does when backward recomputes it, in one place.

Both executors — `strategies.RematChain` (a chain run by rematlab) and `layers.LayerRemat`
(layers run by the model's own loop) — pass `recompute_contexts` to non-reentrant
`torch.utils.checkpoint`: recomputation is timed on the injected clock and counted, and
BatchNorm running statistics are not updated a second time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from rematlab.core import flops as flop_count
from rematlab.core.clocks import Clock, WallClock
from rematlab.exceptions import ConfigError
from rematlab.preflight.cuda_ops import reentered
from rematlab.remat.activations import activations


class RecomputeStats:
    """What recomputation costs during backward: seconds, segments recomputed and, when
    `count_flops` is set, FLOPs. Nested recomputation is counted inside its outermost region."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock or WallClock()
        self.seconds = 0.0
        self.segments = 0
        self.flops = 0
        self.count_flops = False
        self._depth = 0

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        outermost = self._depth == 0
        if outermost:
            self.clock.start()
        counter = flop_count.counter() if outermost and self.count_flops else None
        self._depth += 1
        try:
            with counter if counter is not None else contextlib.nullcontext():
                yield
        finally:
            self._depth -= 1
            self.segments += 1
            if outermost:
                self.seconds += self.clock.stop()
            if counter is not None:
                self.flops += counter.get_total_flops()


@contextlib.contextmanager
def frozen_batchnorm(modules: list[nn.modules.batchnorm._BatchNorm]) -> Iterator[None]:
    """Batch statistics without running-stat updates: what a recomputed forward must do.

    Momentum 0 makes the kernel's update `r = (1 - 0) * r + 0 * batch`, which leaves `r` as it
    is while saving the same tensors as the original forward (checkpoint checks that count);
    `num_batches_tracked` is put back afterwards.
    """
    saved = [(m.momentum, None if m.num_batches_tracked is None else  # a copy, not a number:
              m.num_batches_tracked.detach().clone()) for m in modules]  # fake ones have none
    try:
        for m in modules:
            m.momentum = 0.0
        yield
    finally:
        for m, (momentum, tracked) in zip(modules, saved, strict=True):
            m.momentum = momentum
            if tracked is not None:
                m.num_batches_tracked.copy_(tracked)


def recompute_contexts(stats: RecomputeStats, modules: list[nn.Module]
                       ) -> Callable[[], tuple]:
    """The `context_fn` of a checkpointed region over `modules`: nothing around the first
    forward; around its recomputation, the stats' region, frozen BatchNorm statistics and a
    pre-flight's CUDA dispatch (`rematlab.preflight.cuda_ops.reentered`)."""
    bns = [m for b in modules for m in b.modules()
           if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]

    @contextlib.contextmanager
    def recompute_context() -> Iterator[None]:
        # entered only when backward recomputes the region, not when it is created; a CUDA
        # target's dispatch is re-entered there, as backward runs without it
        with stats.region(), frozen_batchnorm(bns), reentered():
            yield

    return lambda: (contextlib.nullcontext(), recompute_context())


def selective_contexts(stats: RecomputeStats, modules: list[nn.Module], policy: Callable
                       ) -> Callable[[], tuple]:
    """The `context_fn` of an op-level option: torch's selective checkpointing under
    `policy` (which outputs are saved), with `recompute_contexts`' timing and BatchNorm
    freezing around the recomputation."""
    ours = recompute_contexts(stats, modules)

    def contexts() -> tuple:
        save, replay = create_selective_checkpoint_contexts(policy)
        _, recompute = ours()
        return save, _around(recompute, replay)

    return contexts


@contextlib.contextmanager
def _around(outer: contextlib.AbstractContextManager, inner: contextlib.AbstractContextManager
            ) -> Iterator[None]:
    """`inner` (selective checkpointing's replay) inside `outer`: the replay must see the
    forward's ops and no others, such as BatchNorm's counter read by `frozen_batchnorm`."""
    with outer, inner:
        yield


def checked_modules(block: nn.Module, names: tuple[str, ...], where: str) -> tuple[str, ...]:
    """`names` if each is an activation function of `block` (`activations.activations`: what
    a module-level option is made of), named once; a plan file edited to name another
    submodule, or made for another model, is refused with what the block has instead."""
    offered = activations(block)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"the plan names {', '.join(map(repr, twice))} twice in {where}'s "
                          "module-level option: it was edited; plan again")
    foreign = [n for n in names if n not in offered]
    if foreign:
        has = ", ".join(offered[:6]) + (" ..." if len(offered) > 6 else "") or "none"
        raise ConfigError(f"the plan recomputes {', '.join(map(repr, foreign))} in {where}, "
                          f"which is not among its activation modules ({has}): it was edited "
                          "or made for another model; plan again")
    return names


@contextlib.contextmanager
def recomputed_modules(block: nn.Module, names: tuple[str, ...], stats: RecomputeStats,
                       where: str) -> Iterator[None]:
    """`block` run with its submodules `names` checkpointed: each keeps its input for
    backward and runs again there, through `recompute_contexts` (timed, BatchNorm frozen),
    instead of holding what its own ops save. How a module-level option runs: no dispatch
    mode sees each op, so the per-op host cost of selective checkpointing is not paid.
    The submodules' own `forward`s are put back when the block's forward returns."""
    subs = [block.get_submodule(name) for name in checked_modules(block, names, where)]
    for sub in subs:
        inner, contexts = sub.forward, recompute_contexts(stats, [sub])

        def checkpointed(*args: Any, _inner: Callable = inner, _contexts: Callable = contexts,
                         **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, context_fn=_contexts,
                              **kwargs)
        object.__setattr__(sub, "forward", checkpointed)
    try:
        yield
    finally:
        for sub in subs:
            object.__delattr__(sub, "forward")
