"""Memory probes, swappable so measurement logic is testable without hardware (clocks:
`rematlab.core.clocks`).

CPU memory. There is no `max_memory_allocated` on CPU, and RSS counts allocator caches and
the interpreter. `LiveTensorTracker` counts tensor memory directly: the op recorder
(`rematlab.core.dispatch`) shows it every tensor an op creates; it registers the tensor's
storage once (views and in-place results share it) and subtracts the bytes when the storage
is freed (a weak reference on the storage object, which torch keeps alive exactly as long as
the storage). Tensors that existed before tracking
(parameters, optimizer state, the batch) are registered explicitly with `track`. It sees ops
that autograd runs in backward and in recomputation; it cannot see inside compiled kernels.

Tensors are not all the memory a step needs: kernels allocate scratch buffers inside an op
(oneDNN's convolution backward reorders whole activations) and compiled code allocates without
dispatching. `CpuAllocatorTrace` counts what the c10 CPU allocator hands out, through the
profiler's memory events; CPU peaks of record are the larger of the two counts.

CUDA (NVIDIA and ROCm): `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`,
which counts every allocation through the caching allocator, compiled code included. Those
statistics are the process's: another model's tensors on the card are in them. A step's peak
means the same on every device: the step's own tensors that exist before it (tracked, as on
CPU) plus what the step allocates above the level at entry; the rest of the process's
tensors are reported beside it (`StepMemory.other`), never in it. The statistics are read
through `CudaStats`, which a test replaces with a fake card.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.profiler import ProfilerActivity, profile, record_function

from rematlab.core.dispatch import OpCall, Recorded
from rematlab.exceptions import SimulatedOOM

CUDA_BLOCK = 512  # the CUDA caching allocator's smallest block, `kMinBlockSize`: its unit


def rounded(nbytes: int, unit: int) -> int:
    """`nbytes` rounded up to a multiple of the allocator's block size `unit`."""
    return -(-nbytes // unit) * unit


class AllocationListener(Protocol):
    """Told of each storage a tracker sees allocated and freed, in order, by a key that names
    it until it is freed (`rematlab.preflight.caching` replays them through the caching
    allocator's rules; `preflight.kernels` adds the scratch kernels ask for)."""

    def alloc(self, key: Hashable, nbytes: int) -> None: ...

    def free(self, key: Hashable) -> None: ...


class LiveTensorTracker(Recorded):
    """Counts live tensor bytes (storage-deduplicated) and their peak while active: an
    `OpRecorder` listener (`with tracker:` records with it alone).

    `cap`: raise `SimulatedOOM` as soon as live bytes exceed it (a smaller device emulated).
    `unit`: count every storage rounded up to this block size (512 on CUDA, whose caching
    allocator hands out 512-byte multiples), for predictions made on the meta device.
    `listener`: an `AllocationListener`, told of each storage's allocation and free.
    Storages allocated inside `host_allocations()` (offload's host buffers, `remat.offload`) are
    counted apart, in `host_live` and `host_peak`, never in `live`: on a CPU, or a fake
    twin of a GPU run, both are one kind of tensor, and only the offloader knows which.
    """

    method = "dispatch_live_storages"

    def __init__(self, cap: int | None = None, unit: int = 1) -> None:
        self.cap = cap
        self.unit = unit  # allocation granularity: 512 B models the CUDA caching allocator
        self.live = 0
        self.peak = 0
        self.host_live = 0
        self.host_peak = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._host: set[int] = set()
        self._hosting = False
        self.listener: AllocationListener | None = None

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Register tensors that already exist (parameters, optimizer state, inputs)."""
        for t in tensors:
            self._register(t)

    def reset_peak(self) -> None:
        self.peak = self.live
        self.host_peak = self.host_live

    @contextlib.contextmanager
    def host_allocations(self) -> Iterator[None]:
        """Count the storages allocated inside as host memory (offload's host buffers)."""
        self._hosting = True
        try:
            yield
        finally:
            self._hosting = False

    def _register(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.is_sparse:
            return
        storage = t.untyped_storage()
        key = id(storage)
        nbytes = rounded(storage.nbytes(), self.unit)
        known = self._sizes.get(key)
        if known is not None and self._refs[key]() is storage:
            if nbytes == known:
                return
            self._free(key)  # resized in place: freed, then allocated at its new size
        self._sizes[key] = nbytes
        self._refs[key] = weakref.ref(storage, lambda _, k=key: self._free(k))
        if self._hosting:
            self._host.add(key)
            self.host_live += nbytes
            self.host_peak = max(self.host_peak, self.host_live)
            return
        self.live += nbytes
        if self.listener is not None:
            self.listener.alloc(key, storage.nbytes())
        self._bump()

    def _free(self, key: int) -> None:
        nbytes = self._sizes.pop(key, 0)
        self._refs.pop(key, None)
        if key in self._host:
            self._host.discard(key)
            self.host_live -= nbytes
            return
        self.live -= nbytes
        if self.listener is not None:
            self.listener.free(key)

    def _bump(self, level: int | None = None) -> None:
        """A new peak if `level` (default: what is live now) is above the last."""
        level = self.live if level is None else level
        if level > self.peak:
            self.peak = level
            if self.cap is not None and level > self.cap:
                raise SimulatedOOM(f"live tensor bytes {level} exceed the cap {self.cap}")

    def on_op(self, call: OpCall) -> None:
        """The op's scratch charged above what was live before it, then its outputs."""
        if call.transient:
            self._bump(self.live + call.transient)
        for t in call.outs:
            self._register(t)
        if self.listener is not None and call.scratch:  # the kernel's order (`OpCall`)
            for i, nbytes in enumerate(call.scratch):
                self.listener.alloc((id(call), i), nbytes)
            for i in range(len(call.scratch)):
                self.listener.free((id(call), i))


@dataclass(frozen=True)
class Span:
    """Allocator bytes above the trace's entry level: at a phase's start and at its peak."""

    start: int
    peak: int

    @property
    def transient(self) -> int:
        return self.peak - self.start


class CpuAllocatorTrace:
    """What the c10 CPU allocator hands out while active: the peak above the level at entry,
    and per named phase (`with trace.phase("backward"): ...`).

    With the profiler's `profile_memory`, the allocator reports every allocation and free;
    the running sum of those events, in time order, is the CPU counterpart of CUDA's
    `max_memory_allocated`: it includes kernel workspaces and what compiled code allocates.
    The allocator only knows the sizes of blocks allocated while profiling, so the frees of
    older tensors go unseen: open one trace around the whole region (a step, a block's forward
    and backward) and read its phases, rather than one trace per phase.
    """

    method = "c10_cpu_allocator_events"
    _PREFIX = "rematlab::phase::"

    def __init__(self) -> None:
        # kineto prints a line per profiler start and stop on stderr unless told not to
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.peak = 0
        self.phases: dict[str, Span] = {}

    def __enter__(self) -> CpuAllocatorTrace:
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._prof.__exit__(*exc)
        events = self._prof.profiler.kineto_results.events()
        memory = sorted((e.start_ns(), i, e.nbytes()) for i, e in enumerate(events)
                        if e.name() == "[memory]" and str(e.device_type()).endswith("CPU"))
        ranges = [(e.name()[len(self._PREFIX):], e.start_ns(), e.end_ns()) for e in events
                  if e.name().startswith(self._PREFIX)]
        level, levels = 0, []
        for ns, _, nbytes in memory:
            level += nbytes
            levels.append((ns, level))
        self.peak = max([0, *(lv for _, lv in levels)])
        for name, begin, end in ranges:
            before = [lv for ns, lv in levels if ns < begin]
            start = before[-1] if before else 0
            inside = [lv for ns, lv in levels if begin <= ns <= end]
            self.phases[name] = Span(start, max([start, *inside]))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with record_function(self._PREFIX + name):
            yield


class CudaStats(Protocol):
    """The caching allocator's statistics as `torch.cuda` gives them (the module itself is
    one); a test passes a fake card."""

    def synchronize(self, device: torch.device) -> None: ...

    def memory_allocated(self, device: torch.device) -> int: ...

    def max_memory_allocated(self, device: torch.device) -> int: ...

    def max_memory_reserved(self, device: torch.device) -> int: ...

    def reset_peak_memory_stats(self, device: torch.device) -> None: ...


class CudaAllocatorTrace:
    """`CpuAllocatorTrace`'s interface over the CUDA caching allocator's peak statistics,
    above the process's level at entry."""

    method = "torch.cuda.max_memory_allocated"

    def __init__(self, device: torch.device, stats: CudaStats | None = None) -> None:
        self.device = device
        self.stats: CudaStats = stats if stats is not None else torch.cuda
        self.peak = 0
        self.phases: dict[str, Span] = {}
        self._base = 0

    def _level(self, stat: str) -> int:
        self.stats.synchronize(self.device)
        return getattr(self.stats, stat)(self.device) - self._base

    def __enter__(self) -> CudaAllocatorTrace:
        self._base = self._level("memory_allocated")
        self.stats.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = max(self.peak, self._level("max_memory_allocated"))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.peak = max(self.peak, self._level("max_memory_allocated"))
        start = self._level("memory_allocated")
        self.stats.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            top = self._level("max_memory_allocated")
            self.phases[name] = Span(start, top)
            self.peak = max(self.peak, top)


def allocator_trace(device: torch.device, stats: CudaStats | None = None
                    ) -> CpuAllocatorTrace | CudaAllocatorTrace:
    """The allocator-level probe for `device` (CPU or CUDA)."""
    return (CudaAllocatorTrace(device, stats) if device.type == "cuda"
            else CpuAllocatorTrace())


class MemoryProbe(Protocol):
    """The peak memory of one training step: register what exists before it (`track`),
    enter it around the step, wrap each phase in `phase(name)`; then read absolute bytes."""

    method: str
    peak: int
    reserved: int
    phase_peaks: dict[str, int]

    def track(self, tensors: Iterable[torch.Tensor]) -> None: ...

    def phase(self, name: str) -> contextlib.AbstractContextManager: ...

    def __enter__(self) -> MemoryProbe: ...

    def __exit__(self, *exc: object) -> None: ...


class StepMemory:
    """`MemoryProbe` for CPU and CUDA, the one way rematlab measures a step's peak (`measure`
    and the planner's verification both use it).

    CPU: the larger of the live tensors (`LiveTensorTracker`, above the tracked tensors; off
    with `tensors_seen=False` for compiled code, which it cannot see into) and the allocator's
    count (`CpuAllocatorTrace`) above the same base. CUDA: the caching allocator's peak above
    `memory_allocated` at entry, plus the step's tracked tensors (in the allocator's 512-byte
    blocks), not the process's level: `other` holds what the rest of the process had
    allocated at entry (another model on the card), reported beside the peak. The BLAS
    workspaces are freed at entry, so that the step's peak holds those it allocates, as
    the simulation does (`planning.planner.prepare`), whatever ran before it. `reserved` is
    the allocator's reserved peak less `other`. `cap` makes the tracker raise `SimulatedOOM`
    as soon as live bytes exceed it. `stats`: the CUDA statistics (`CudaStats`).
    """

    def __init__(self, device: torch.device, cap: int | None = None,
                 tensors_seen: bool = True, stats: CudaStats | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stats: CudaStats = stats if stats is not None else torch.cuda
        self.tracker = LiveTensorTracker(cap, unit=CUDA_BLOCK if self.cuda else 1)
        self.tensors_seen = tensors_seen and not self.cuda
        self.allocator = allocator_trace(device, self.stats)
        self.other = 0
        self.method = (CudaAllocatorTrace.method if self.cuda else
                       f"max({LiveTensorTracker.method}, {CpuAllocatorTrace.method})")
        self.base = 0
        self.peak = 0
        self.reserved = 0
        self.phase_peaks: dict[str, int] = {}
        self._reserved: dict[str, int] = {}

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        self.tracker.track(tensors)

    def __enter__(self) -> StepMemory:
        self.base = self.tracker.live
        if self.cuda:
            self.stats.synchronize(self.device)
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None and self.stats is torch.cuda:
                clear()  # the step allocates its BLAS workspaces again, inside its peak
            self.other = max(0, self.stats.memory_allocated(self.device) - self.base)
        self.tracker.reset_peak()
        self.allocator.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.allocator.__exit__(*exc)
        for name, span in self.allocator.phases.items():
            self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self.base + span.peak)
        self.peak = max([self.base + self.allocator.peak, *self.phase_peaks.values()])
        if self.tensors_seen:
            self.peak = max(self.peak, self.tracker.peak)
        self.reserved = max(self.peak, max(self._reserved.values(), default=0) - self.other) \
            if self.cuda else self.peak

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with self.allocator.phase(name):
            if self.tensors_seen:
                self.tracker.reset_peak()
                with self.tracker:
                    yield
                self.phase_peaks[name] = self.tracker.peak
            else:
                yield
            if self.cuda:
                self._reserved[name] = self.stats.max_memory_reserved(self.device)


PhaseMarker = Callable[[str], contextlib.AbstractContextManager]


def peak_of(memory: MemoryProbe, persistent: Iterable[torch.Tensor],
            step: Callable[[PhaseMarker], object]) -> MemoryProbe:
    """The one way a step's peak is taken: what exists before the step (parameters, buffers,
    optimizer state, the batch) is tracked, then the step runs inside the probe, marking its
    phases with the marker it is given. Returns the probe, its `peak` read."""
    memory.track(persistent)
    with memory:
        step(memory.phase)
    return memory


def one_phase(fn: Callable[[], object]) -> Callable[[PhaseMarker], object]:
    """A step with no phases of its own, marked as one phase, `step`."""
    def run(phase: PhaseMarker) -> None:
        with phase("step"):
            fn()
    return run


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identity of a tensor's storage (device and data pointer; meta tensors by object id)."""
    if t.device.type == "meta" or isinstance(t, FakeTensor):  # no data, no address
        return ("meta", id(t.untyped_storage()))
    return (str(t.device), t.untyped_storage().data_ptr())
