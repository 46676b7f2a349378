"""Step time without running: every aten op a block runs (forward, backward, recompute) is
logged by the op recorder (`rematlab.core.dispatch`) with its FLOPs and the bytes it reads
and writes; a target prices the log as a roofline, `max(FLOPs / compute rate, bytes /
bandwidth) + per-op overhead` (`rematlab.preflight.pricing.interval`).

Fake tensors (`rematlab.preflight.fake`) run the same dispatch as real ones, so the log holds
the ops a real step runs — the kernels chosen for this device's attention, the backward
autograd builds — with their exact shapes, and costs nothing. Matmuls, convolutions and
attention are priced at the target's matmul rate for their dtype (convolutions at the
target's `conv` share of it), everything else by its bytes. Views move nothing and cost no
time. A time is an interval: the target's slowest, typical and fastest efficiencies
(`Target.efficiency`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rematlab.core.dispatch import OpCall, Recorded

CONV = frozenset(("convolution", "convolution_backward", "_convolution"))
FREE = frozenset(("detach", "alias", "lift_fresh", "empty", "empty_strided", "empty_like",
                  "new_empty", "new_empty_strided", "set_", "resize_"))


@dataclass(frozen=True)
class LoggedOp:
    """One aten op as the roofline prices it."""

    name: str  # the aten op's name, without overload
    kind: str  # "matmul", "conv" or "vector"
    dtype: str
    flops: float
    nbytes: int


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def logged(call: OpCall) -> LoggedOp | None:
    """How the roofline sees one dispatched op; None for views and ops that move nothing."""
    if not call.outs or call.func.is_view or call.name in FREE:
        return None
    kind = "vector" if not call.flops else ("conv" if call.name in CONV else "matmul")
    dtype = str(call.outs[0].dtype).removeprefix("torch.")
    return LoggedOp(call.name, kind, dtype, call.flops,
                    sum(map(_nbytes, call.ins + call.outs)))


class OpLog(Recorded):
    """Logs every op dispatched while active (see module docstring): an `OpRecorder`
    listener."""

    def __init__(self) -> None:
        self.ops: list[LoggedOp] = []

    def on_op(self, call: OpCall) -> None:
        op = logged(call)
        if op is not None:
            self.ops.append(op)
