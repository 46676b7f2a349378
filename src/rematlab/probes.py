"""Clocks and memory probes, swappable so measurement logic is testable without hardware.

CPU memory. There is no `max_memory_allocated` on CPU, and RSS counts allocator caches and
the interpreter. `LiveTensorTracker` counts tensor memory directly: a dispatch mode sees every
tensor an op creates, registers its storage once (views and in-place results share it) and
subtracts the bytes when the storage is freed (a weak reference on the storage object, which
torch keeps alive exactly as long as the storage). Tensors that existed before tracking
(parameters, optimizer state, the batch) are registered explicitly with `track`. It sees ops
that autograd runs in backward and in recomputation; it cannot see inside compiled kernels.

CUDA (NVIDIA and ROCm): `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`,
which counts every allocation through the caching allocator, compiled code included.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable
from typing import Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rematlab.exceptions import SimulatedOOM


class Clock(Protocol):
    """Times a region: `start()` then `stop()` returns seconds, synchronising the device."""

    def start(self) -> None: ...

    def stop(self) -> float: ...


class WallClock:
    """`time.perf_counter` around a region, synchronising CUDA first when given a device."""

    method = "perf_counter"

    def __init__(self, device: torch.device | None = None) -> None:
        self._cuda = device is not None and device.type == "cuda"
        self._t0 = 0.0

    def start(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - self._t0


class CudaEventClock:
    """CUDA events recorded on the current stream; elapsed time after a synchronize."""

    method = "cuda_events"

    def __init__(self) -> None:
        self._begin = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self._begin.record()

    def stop(self) -> float:
        self._end.record()
        self._end.synchronize()
        return self._begin.elapsed_time(self._end) / 1000.0


def clock_for(device: torch.device) -> Clock:
    return CudaEventClock() if device.type == "cuda" else WallClock(device)


def rounded(nbytes: int, unit: int) -> int:
    """`nbytes` rounded up to a multiple of the allocator's block size `unit`."""
    return -(-nbytes // unit) * unit


class LiveTensorTracker(TorchDispatchMode):
    """Counts live tensor bytes (storage-deduplicated) and their peak while active.

    `cap`: raise `SimulatedOOM` as soon as live bytes exceed it (a smaller device emulated).
    `unit`: count every storage rounded up to this block size (512 on CUDA, whose caching
    allocator hands out 512-byte multiples), for predictions made on the meta device.
    """

    method = "dispatch_live_storages"

    def __init__(self, cap: int | None = None, unit: int = 1) -> None:
        super().__init__()
        self.cap = cap
        self.unit = unit  # allocation granularity: 512 B models the CUDA caching allocator
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Register tensors that already exist (parameters, optimizer state, inputs)."""
        for t in tensors:
            self._register(t)

    def reset_peak(self) -> None:
        self.peak = self.live

    def _register(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.is_sparse:
            return
        storage = t.untyped_storage()
        key = id(storage)
        nbytes = rounded(storage.nbytes(), self.unit)
        known = self._sizes.get(key)
        if known is not None and self._refs[key]() is storage:
            if nbytes != known:  # resized in place
                self.live += nbytes - known
                self._sizes[key] = nbytes
                self._bump()
            return
        self._sizes[key] = nbytes
        self._refs[key] = weakref.ref(storage, lambda _, k=key: self._free(k))
        self.live += nbytes
        self._bump()

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def _bump(self) -> None:
        if self.live > self.peak:
            self.peak = self.live
            if self.cap is not None and self.live > self.cap:
                raise SimulatedOOM(f"live tensor bytes {self.live} exceed the cap {self.cap}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._register(t)
        return out


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identity of a tensor's storage (device and data pointer; meta tensors by object id)."""
    if t.device.type == "meta":
        return ("meta", id(t.untyped_storage()))
    return (str(t.device), t.untyped_storage().data_ptr())
