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
cached blocks that do not fit later requests (fragmentation). `reserved_bounds` gives the
least it can be — every live block in segments of its own pool, packed — which is the
allocated peak plus the rounding of each large tensor and of each pool's last segment; the
allocator's own `expandable_segments` setting approaches it. The CUDA context (driver and
kernels, `Target.context`) is outside the allocator altogether.
"""

from __future__ import annotations

MIN_BLOCK = 512
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


def reserved_bounds(live: list[int]) -> int:
    """The least `memory_reserved` can be while tensors of `live` bytes are alive: large
    tensors in segments rounded to 2 MiB, the rest packed into their pools' segments."""
    small = sum(block(n) for n in live if block(n) <= SMALL_SIZE)
    medium = sum(block(n) for n in live if SMALL_SIZE < block(n) < MIN_LARGE_ALLOC)
    large = sum(segment(n) for n in live if block(n) >= MIN_LARGE_ALLOC)
    return _up(small, SMALL_BUFFER) + _up(medium, LARGE_BUFFER) + large
