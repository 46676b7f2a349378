"""The host allocator rematlab's own processes measure under: glibc keeping what it frees.

With glibc's defaults a CPU step's time depends on where earlier allocations left the heap:
large tensors are mapped fresh and handed back at every step (page faults each time), and
the heap is trimmed at random points (a ResNet plan's measured ratio moved between 1.78x
and 2.35x across runs of the pre-flight benchmark). It is one source of disagreement
between processes, not the only one (`docs/benchmarks/repeatability.md`).
`retain_freed_memory` makes glibc keep what the process frees, as PyTorch's CUDA caching
allocator keeps device memory: no block is mmapped, the heap is never trimmed, and a step
reuses pages. The process's resident memory stays at its high-water mark, which a measuring
process does not mind and a user's training process might: so it is on by default in
rematlab's own processes (the `rematlab` command, sweep workers, Ray tasks),
`REMATLAB_HOST_ALLOCATOR=default` turns it off there, and a user's process is never changed
unless the user calls `retain_freed_memory()` itself. Every measured row records which
allocator it ran under (`host_allocator`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from rematlab.exceptions import ConfigError

ENV = "REMATLAB_HOST_ALLOCATOR"
RETAINED = "glibc-retains-freed"  # what a row records, by setting
DEFAULT = "default"
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4  # glibc's malloc.h
_setting = DEFAULT


def retain_freed_memory() -> bool:
    """Make glibc keep what this process frees (see the module docstring); False where
    the C library has no `mallopt` (not glibc), and nothing changed."""
    global _setting
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not all((mallopt(_M_MMAP_MAX, 0),
                                   mallopt(_M_TRIM_THRESHOLD, 2**31 - 1),
                                   mallopt(_M_TOP_PAD, 256 << 20))):
        return False
    _setting = RETAINED
    return True


def asked() -> str:
    """The setting `REMATLAB_HOST_ALLOCATOR` asks rematlab's own processes for: "retain"
    (unset) or "default"; a `ConfigError` for anything else."""
    choice = os.environ.get(ENV, "retain").strip().lower()
    if choice not in ("retain", DEFAULT):
        raise ConfigError(f"{ENV}={choice!r}: choose retain or default")
    return choice


def own_process() -> str:
    """Apply the setting of one of rematlab's own processes (`asked`); returns what this
    process now runs under."""
    if asked() == "retain":
        retain_freed_memory()
    return _setting


def host_allocator() -> str:
    """What this process's host allocator runs under: `RETAINED` or `DEFAULT`."""
    return _setting


def describe() -> str:
    """One sentence for a document's method section."""
    if _setting == RETAINED:
        return ("glibc keeps freed memory (`mallopt`: no mmapped blocks, heap never trimmed; "
                "`rematlab.core.hostmem`)")
    return "the C library's allocator with its defaults"
