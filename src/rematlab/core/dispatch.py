"""The one dispatch mode that records ops: `OpRecorder` runs each aten op once and tells its
listeners about the call, in the order they were given.

Every instrument that watches ops is a listener: the live-storage meter (`probes.
LiveTensorTracker`, and the sharded rank meter built on it), autocast's weight copies
(`precision.CastRecorder`), the roofline's op log (`preflight.roofline.OpLog`), calibration's
op timer, the op menus' recorder (`remat.ops`) and the kernels' scratch
(`preflight.kernels`, `preflight.workspace`). One mode instead of one per instrument means
each op is timed once, its FLOPs are counted once (`OpCall.flops`, from the formulas of
`core.flops`), and the instruments cannot disagree about which ops ran: stacked modes each
re-dispatch the op, and the order they were entered in decided who saw what first.

Kernel scratch (memory a kernel holds inside one op, which no tensor it returns owns) is
charged through the call: a listener raises `OpCall.transient` and lists the blocks in
`OpCall.scratch`; the live-storage meter, listed after it, reaches that level before it
registers the op's outputs. Nobody writes another object's peak.
"""

from __future__ import annotations

import abc
import functools
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rematlab.core.flops import formula

Timing = Literal["host", "events"]


@dataclass
class OpCall:
    """One dispatched aten op: what it was called with and what it returned.

    `seconds`: the op's time, when the recorder times (host: around the call, which on a
    CPU runs the kernel; events: the kernels between two CUDA events, filled in by
    `OpRecorder.finish`). `transient`: the bytes the op held at its peak above what was
    live before it, outputs included, as a scratch listener charges it; `scratch`: those
    blocks, for an allocator replay (outputs first, then the scratch, then the scratch freed).
    """

    func: Any
    args: tuple
    kwargs: dict
    out: Any = None
    seconds: float = 0.0
    transient: int = 0
    scratch: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The op's packet name: `mm`, `_scaled_dot_product_flash_attention_backward`."""
        return self.func._overloadpacket.__name__

    @functools.cached_property
    def outs(self) -> list[torch.Tensor]:
        """The tensors the op returned, flattened."""
        return [t for t in tree_leaves(self.out) if isinstance(t, torch.Tensor)]

    @functools.cached_property
    def ins(self) -> list[torch.Tensor]:
        """The tensors the op was called with, flattened."""
        return [t for t in tree_leaves((self.args, self.kwargs)) if isinstance(t, torch.Tensor)]

    @functools.cached_property
    def flops(self) -> float:
        """The op's FLOPs by torch's formulas (0 for ops without one), counted once."""
        count = formula(self.func._overloadpacket)
        return float(count(*self.args, **self.kwargs, out_val=self.out)) if count else 0.0


class OpListener(Protocol):
    """Told of each op after it ran."""

    def on_op(self, call: OpCall) -> None: ...


class OpRecorder(TorchDispatchMode):
    """Runs every op dispatched while active and tells `listeners` about it (module
    docstring). `timing`: None, "host" (perf_counter around the call) or "events" (a pair of
    CUDA events per op, read by `finish` after one synchronisation: synchronising around every
    op would add the host's launch latency to each, and make cheap pointwise ops look as dear
    as a matmul)."""

    def __init__(self, *listeners: OpListener, timing: Timing | None = None) -> None:
        super().__init__()
        self.listeners = listeners
        self.timing = timing
        self._pending: list[tuple[OpCall, Any, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        call = OpCall(func, args, kwargs or {})
        if self.timing == "events":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            call.out = func(*args, **call.kwargs)
            end.record()
            self._pending.append((call, start, end))
        elif self.timing == "host":
            t0 = time.perf_counter()
            call.out = func(*args, **call.kwargs)
            call.seconds = time.perf_counter() - t0
        else:
            call.out = func(*args, **call.kwargs)
        for listener in self.listeners:
            listener.on_op(call)
        return call.out

    def finish(self) -> None:
        """With event timing, each call's seconds from its events (the device synchronised
        once); nothing otherwise."""
        if self._pending:
            torch.cuda.synchronize()
            for call, start, end in self._pending:
                call.seconds = start.elapsed_time(end) / 1e3
            self._pending.clear()


class Recorded(abc.ABC):
    """A listener that is also a context manager of its own recorder, for code that watches
    ops with one instrument alone (`with tracker: ...`)."""

    def __enter__(self) -> Recorded:
        recorder = OpRecorder(self)
        self.__dict__.setdefault("_recorders", []).append(recorder)
        recorder.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.__dict__["_recorders"].pop().__exit__(*exc)

    @abc.abstractmethod
    def on_op(self, call: OpCall) -> None: ...

