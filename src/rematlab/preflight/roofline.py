"""Step time without running: every aten op a block runs (forward, backward, recompute) is
logged under a dispatch mode with its FLOPs and the bytes it reads and writes; a target prices
the log as a roofline, `max(FLOPs / compute rate, bytes / bandwidth) + per-op overhead`
(`rematlab.preflight.targets.interval`).

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
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rematlab.core.flops import formula as flop_formula

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


def logged(func, args: tuple, kwargs: dict, out: object) -> LoggedOp | None:
    """How the roofline sees one dispatched op; None for views and ops that move nothing."""
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    name = func._overloadpacket.__name__
    if not outs or func.is_view or name in FREE:
        return None
    ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    formula = flop_formula(func._overloadpacket)
    flops = float(formula(*args, **kwargs, out_val=out)) if formula else 0.0
    kind = "vector" if not flops else ("conv" if name in CONV else "matmul")
    dtype = str(outs[0].dtype).removeprefix("torch.")
    return LoggedOp(name, kind, dtype, flops, sum(map(_nbytes, ins + outs)))


class OpLog(TorchDispatchMode):
    """Logs every op dispatched while active (see module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[LoggedOp] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = logged(func, args, kwargs, out)
        if op is not None:
            self.ops.append(op)
        return out
