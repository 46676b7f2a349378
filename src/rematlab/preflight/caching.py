"""The CUDA caching allocator replayed on a step's allocations and frees, for the memory a card
must *reserve* for a step, not only what its tensors hold at once (`allocated`).

Follows `c10/cuda/CUDACachingAllocator.cpp` (torch 2.13) with its defaults (no
`PYTORCH_CUDA_ALLOC_CONF`: no `expandable_segments`, no `max_split_size_mb`, no
`roundup_power2_divisions`, one stream), its constants in `rematlab.preflight.allocator`:

- `round_size`: a request takes a multiple of 512 bytes (at least 512);
- requests up to 1 MiB come from the small pool, larger ones from the large pool;
- `get_free_block`: the smallest cached free block of the pool that is large enough (best
  fit; ties to the lower address);
- otherwise `alloc_block` reserves a new segment (`get_allocation_size`): 2 MiB for the small
  pool, 20 MiB for requests under 10 MiB, else the request rounded up to 2 MiB;
- `should_split`: the rest of a block becomes a free block when at least 512 bytes remain
  (small pool) or more than 1 MiB (large pool); otherwise the whole block is handed out;
- `free_block`: a freed block merges with its free neighbours in its segment, and stays
  cached — segments are only returned to the driver when a request would not fit
  (`release_cached_blocks`, on the way to an out-of-memory error), or by `empty_cache`.

`reserved` is what `torch.cuda.memory_reserved` reports: the segments' sizes. Where the card's
`capacity` is given, a request that needs a new segment beyond it first releases the wholly
free segments, as the allocator does, and `fits` turns False if that is not enough.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from rematlab.preflight.allocator import MIN_BLOCK, SMALL_SIZE, block, segment


@dataclass(eq=False)
class _Block:
    size: int
    segment: int
    address: int
    small: bool
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None


@dataclass
class CachingAllocator:
    """See the module docstring. `alloc(key, nbytes)` and `free(key)` replay a trace; a
    key already allocated is not allocated again (a storage seen twice)."""

    capacity: int | None = None
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    fits: bool = True
    _pools: dict[bool, list[tuple[int, int, _Block]]] = field(
        default_factory=lambda: {True: [], False: []})
    _live: dict[object, _Block] = field(default_factory=dict)
    _segments: dict[int, int] = field(default_factory=dict)  # id -> size
    _ids: itertools.count = field(default_factory=itertools.count)

    def alloc(self, key: object, nbytes: int) -> None:
        if key in self._live or nbytes <= 0:
            return
        size = max(block(nbytes), MIN_BLOCK)
        small = size <= SMALL_SIZE
        found = self._best_fit(size, small) or self._new_segment(size, small)
        rest = found.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:  # `should_split`
            tail = _Block(rest, found.segment, found.address + size, small, True, found,
                          found.next)
            if found.next is not None:
                found.next.prev = tail
            found.next, found.size = tail, size
            self._insert(tail)
        found.free = False
        self._live[key] = found
        self.allocated += found.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: object) -> None:
        b = self._live.pop(key, None)
        if b is None:
            return
        self.allocated -= b.size
        b.free = True
        for other in (b.prev, b.next):  # `try_merge_blocks`
            if other is not None and other.free:
                self._remove(other)
                if other is b.prev:
                    b.address, b.prev = other.address, other.prev
                    if other.prev is not None:
                        other.prev.next = b
                else:
                    b.next = other.next
                    if other.next is not None:
                        other.next.prev = b
                b.size += other.size
        self._insert(b)

    def _best_fit(self, size: int, small: bool) -> _Block | None:
        pool = self._pools[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        return self._remove(pool[i][2])

    def _new_segment(self, size: int, small: bool) -> _Block:
        grow = segment(size)
        if self.capacity is not None and self.reserved + grow > self.capacity:
            self._release()
            self.fits = self.fits and self.reserved + grow <= self.capacity
        seg = next(self._ids)
        self._segments[seg] = grow
        self.reserved += grow
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return _Block(grow, seg, 0, small, True)

    def _release(self) -> None:
        """`release_cached_blocks`: every wholly free segment back to the driver."""
        for small in (True, False):
            for *_, b in list(self._pools[small]):
                if b.prev is None and b.next is None:
                    self._remove(b)
                    self.reserved -= self._segments.pop(b.segment)

    def _insert(self, b: _Block) -> None:
        bisect.insort(self._pools[b.small], (b.size, self._order(b), b))

    def _remove(self, b: _Block) -> _Block:
        pool = self._pools[b.small]
        i = bisect.bisect_left(pool, (b.size, self._order(b)))
        del pool[i]
        return b

    @staticmethod
    def _order(b: _Block) -> int:
        """A block's place among blocks of its size: lower segments, then lower addresses
        (segments are numbered as they are reserved)."""
        return (b.segment << 48) + b.address
