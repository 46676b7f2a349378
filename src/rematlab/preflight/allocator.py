"""The CUDA caching allocator's rounding, as PyTorch documents it (docs: "CUDA semantics",
memory management; c10/cuda/CUDACachingAllocator.cpp), for predictions made off the GPU.

- Every block is a multiple of 512 bytes (`kMinBlockSize`); a request of n bytes takes
  `block(n)`. `torch.cuda.max_memory_allocated` counts blocks, so a predicted peak counts each
  tensor as `block(n)` (`Target.unit`; `LiveTensorTracker(unit=512)`).
- Blocks are cut from segments the allocator reserves with `cudaMalloc`: requests up to 1 MiB
  (`kSmallSize`) share 2 MiB segments (`kSmallBuffer`); requests up to 10 MiB
  (`kMinLargeAlloc`) take 20 MiB segments (`kLargeBuffer`); larger ones a segment rounded up
  to 2 MiB (`kRoundLarge`). `torch.cuda.memory_reserved` counts segments.

A step's reserved peak lies above its allocated peak by the segments' unused tails and by
cached blocks that do not fit later requests (fragmentation): `rematlab.preflight.caching`
replays a step's allocations through these rules for it. The CUDA context (driver and
kernels, `Target.context`) is outside the allocator altogether.
"""

from __future__ import annotations

from rematlab.core.probes import CUDA_BLOCK as MIN_BLOCK  # the one definition: `kMinBlockSize`

SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def _up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def block(nbytes: int) -> int:
    """Bytes a request of `nbytes` takes from the allocator (what `memory_allocated` counts);
    an empty tensor takes none."""
    return 0 if nbytes <= 0 else _up(nbytes, MIN_BLOCK)


def segment(nbytes: int) -> int:
    """Bytes of the segment `cudaMalloc` reserves when no cached one can serve the request."""
    size = block(nbytes)
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return _up(size, ROUND_LARGE)



def fresh(nbytes: int) -> int:
    """Bytes a request of `nbytes` is handed from a segment reserved for it: the whole
    segment when what would remain is too small to split off (`should_split`: more than
    1 MiB in the large pool), else its block. A 33 MiB workspace takes a 34 MiB block."""
    size, seg = block(nbytes), segment(nbytes)
    return seg if size > SMALL_SIZE and seg - size <= SMALL_SIZE else size
