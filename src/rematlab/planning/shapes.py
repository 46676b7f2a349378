"""Shape buckets for `rematlab.auto`: one profile per bucket of input shapes, not per shape.

Training with dynamic padding (the default of transformers' collators) gives a new sequence
length almost every step; planning each one profiles and verifies almost every step. Instead
the dimensions that change are learned as batches arrive (a dimension is dynamic once a
batch differs there from the first one), each dynamic size is rounded up to a power of two
(its bucket), and the plan is made for the bucket's largest shape, on the batch tiled up to
it. A plan made at a shape fits every shape that is no larger in any dimension: a step's
live bytes grow with every dimension of its inputs (activations are batch × sequence ×
width, attention scores batch × heads × sequence²), so the profiled peak bounds the peak at
any smaller shape under the same plan. That is the test `covers` applies before reusing a
plan; the plan made for the very first batch, before any dimension was seen to change, is
reused the same way for the shapes it covers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rematlab.core.batch import Batch, map_tensors, tensors

Shapes = tuple[tuple[int, ...], ...]  # each tensor's shape, in the batch's order


def shapes_of(batch: Batch) -> Shapes:
    return tuple(tuple(t.shape) for t in tensors(batch))


def bucket_size(n: int) -> int:
    """The power of two at or above `n`: a bucket's largest size."""
    return 1 << max(0, n - 1).bit_length()


def covers(planned: Shapes, shapes: Shapes) -> bool:
    """Whether a plan made at `planned` shapes holds at `shapes`: the same tensors, none
    larger in any dimension (see the module docstring)."""
    return len(planned) == len(shapes) and all(
        len(p) == len(s) and all(a >= b for a, b in zip(p, s, strict=True))
        for p, s in zip(planned, shapes, strict=True))


@dataclass
class ShapeBuckets:
    """Which dimensions of a batch's tensors change, learned from the batches seen, and the
    bucket each batch falls in."""

    first: Shapes | None = None
    dynamic: set[tuple[int, int]] = field(default_factory=set)  # (tensor, dimension)

    def observe(self, shapes: Shapes) -> None:
        if self.first is None:
            self.first = shapes
            return
        if len(shapes) != len(self.first):
            return  # another batch form: a key of its own, nothing learned
        for i, (was, now) in enumerate(zip(self.first, shapes, strict=True)):
            if len(was) == len(now):
                self.dynamic |= {(i, d) for d, (a, b) in enumerate(zip(was, now, strict=True))
                                 if a != b}

    def top(self, shapes: Shapes) -> Shapes:
        """The bucket's largest shapes: each dynamic size rounded up to a power of two."""
        return tuple(tuple(bucket_size(n) if (i, d) in self.dynamic else n
                           for d, n in enumerate(shape))
                     for i, shape in enumerate(shapes))


def tiled(batch: Batch, shapes: Shapes) -> Batch:
    """`batch` grown to `shapes`, each tensor indexed cyclically along every dimension that
    grows: token ids stay ids of the vocabulary, masks stay masks, labels stay labels."""
    sizes = iter(shapes)

    def grow(t: torch.Tensor) -> torch.Tensor:
        for d, n in enumerate(next(sizes)):
            if n > t.shape[d]:
                t = t.index_select(d, torch.arange(n, device=t.device) % t.shape[d])
        return t

    return map_tensors(grow, batch)
