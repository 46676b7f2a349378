"""Scratch memory that kernels allocate inside an op, which no tensor holds and fake tensors
cannot see: on this CPU, oneDNN's convolutions reorder their output, gradient and (for wide
layers) their weights into blocked layouts; backward-by-weights keeps per-thread partial sums.
It reaches 20 % of a CNN step's peak (VGG-16 at CIFAR scale), and it is not affine in the
batch (oneDNN picks another algorithm for one sample than for two). Matrix products pack
their operands too: in bf16 under autocast, a small GPT-2's backward needed 64 KiB more per
layer than its tensors (pre-flight was 3.9 % under its measured peak without it).

So on a device that is here (a calibrated target), each convolution and matrix product a
fake profile runs is also run once for real at its exact shapes and strides, on random data,
under the allocator trace (`rematlab.core.probes.allocator_trace`), and its allocator peak is
charged to the live-tensor tracker at that moment (`Scratch`). Results are cached per op and
shapes, so a repeated layer
costs one run. A data-sheet target has no device to ask: its convolutions' workspaces
(cuDNN's) are not modelled, which `docs/benchmarks/preflight.md` says.
"""

from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from rematlab.core.dispatch import OpCall
from rematlab.core.probes import allocator_trace

OPS = frozenset(("convolution", "convolution_backward", "mm", "addmm", "bmm", "baddbmm"))


def _spec(value: object) -> object:
    if isinstance(value, torch.Tensor):  # strides too: a transposed operand takes another path
        return ("tensor", tuple(value.shape), value.dtype, tuple(value.stride()))
    if isinstance(value, (list, tuple)):
        return tuple(_spec(v) for v in value)
    return value


def _is_tensor(spec: object) -> bool:
    return isinstance(spec, tuple) and spec[:1] == ("tensor",)


def _random(spec: tuple, device: str) -> torch.Tensor:
    """A tensor of `spec`'s shape, dtype and strides, on random data (zeros if integral)."""
    _, shape, dtype, stride = spec
    t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    return t.normal_() if t.is_floating_point() else t.zero_()


@functools.cache
def _measured(device: str, name: str, spec: tuple) -> int:
    """Allocator bytes one call of the op takes at its peak (outputs included), measured on
    random data of the op's shapes (cached: one run per op and shapes)."""
    func = getattr(torch.ops.aten, name).default
    args = tree_map(lambda s: _random(s, device) if _is_tensor(s) else s, spec,
                    is_leaf=_is_tensor)
    with torch.no_grad():
        func(*args)  # oneDNN primitives are created on first use
        trace = allocator_trace(torch.device(device))
        with trace, trace.phase("op"):
            out = func(*args)
        del out
    return trace.phases["op"].transient


class Scratch:
    """An `OpRecorder` listener that charges each convolution's and matrix product's
    measured allocator peak (see module docstring) to the call, for the live-storage meter
    listed after it. `device`: where to measure ("cpu")."""

    def __init__(self, device: str) -> None:
        self.device = device

    def on_op(self, call: OpCall) -> None:
        if call.name in OPS and not call.kwargs:
            with _disable_current_modes():
                need = _measured(self.device, call.name, _spec(tuple(call.args)))
            call.transient = max(call.transient, need)
