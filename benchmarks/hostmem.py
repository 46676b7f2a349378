"""The host allocator setting the CPU benchmarks measure under (`retain_freed_memory`)."""

from __future__ import annotations

import ctypes
import ctypes.util


def retain_freed_memory() -> str:
    """Make glibc keep what the process frees, as PyTorch's CUDA caching allocator does on a
    GPU: no block is mmapped (and unmapped again when freed) and the heap is never trimmed,
    so a step reuses pages instead of faulting fresh ones in. With glibc's defaults a step's
    time depends on where earlier allocations left the heap: the same ResNet plan measured
    1.78x to 2.35x no checkpointing in separate runs, each run's rounds within 4 %
    (docs/benchmarks/preflight.md). Returns what the document says about the setting."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = getattr(libc, "mallopt", None)
    m_trim_threshold, m_top_pad, m_mmap_max = -1, -2, -4  # glibc's malloc.h
    if mallopt is None or not all((mallopt(m_mmap_max, 0), mallopt(m_trim_threshold, 2**31 - 1),
                                   mallopt(m_top_pad, 256 << 20))):
        return "the C library's allocator as it is (no glibc `mallopt`)"
    return ("glibc keeps freed memory (`mallopt`: no mmapped blocks, heap never trimmed; "
            "`benchmarks/hostmem.py`)")
