"""What every checkpointed region does when backward recomputes it, in one place.

Both executors — `strategies.RematChain` (a chain run by rematlab) and `layers.LayerRemat`
(layers run by the model's own loop) — pass `recompute_contexts` to non-reentrant
`torch.utils.checkpoint`: recomputation is timed on the injected clock and counted, and
BatchNorm running statistics are not updated a second time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from rematlab.core import flops as flop_count
from rematlab.core.clocks import Clock, WallClock
from rematlab.preflight.cuda_ops import reentered


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
