"""What a target takes to run logged ops: the roofline's seconds of an op log on a `Target`
(`rematlab.preflight.targets`) at one of its efficiency bounds, checkpointing's and selective
checkpointing's own host work, and a fake block's times priced from the ops it ran, so that
one fake profile prices every card of its kind (`rematlab.preflight.shared`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rematlab.preflight.roofline import LoggedOp
from rematlab.preflight.targets import BOUNDS, Target


def seconds(ops: list[LoggedOp], target: Target, bound: str = "typical") -> float:
    """The roofline time of `ops` on `target` at one of its efficiency bounds: an op whose
    rate was calibrated (`Target.extra["rates"]`, by op name) at that rate, any other at its
    class's peak times the target's efficiency; each op also costs the target's per-op
    overhead (dispatch and launch). A CPU runs an op's overhead and its work one after the
    other. A GPU runs them side by side: the host launches kernels ahead of the device, so a
    step takes the longer of its kernels' time and its launches' time (launch-bound at small
    sizes, kernel-bound at large ones), not their sum."""
    kernels, launches = _parts(ops, target, bound)
    return max(kernels, launches) if target.kind == "cuda" else kernels + launches


def checkpoint_seconds(ops: list[LoggedOp], target: Target, bound: str = "typical") -> float:
    """What checkpointing a block whose forward runs `ops` adds to a step beyond running
    `ops` again: checkpoint's own host work. Measured on a calibrated target
    (`extra["checkpoint"]`); else the target's `checkpoint_host`, which on a GPU overlaps
    with the recomputation's kernels as its launches do: it costs only what the host falls
    behind the device by (`max(kernels, launches + host) - max(kernels, launches)`)."""
    if "checkpoint" in target.extra:
        return target.extra["checkpoint"]
    host = target.checkpoint_host[2 - BOUNDS[bound]]
    if target.kind != "cuda":
        return host
    kernels, launches = _parts(ops, target, bound)
    return max(kernels, launches + host) - max(kernels, launches)


def selective_seconds(ops: list[LoggedOp], target: Target, bound: str = "typical") -> float:
    """What selective checkpointing's dispatch mode adds to one pass over `ops` (the
    forward of an op-level option, or its recomputation): `selective_host` per op, which on
    a GPU overlaps with the kernels as launches do (only what the host falls behind by)."""
    host = len(ops) * target.selective_host[2 - BOUNDS[bound]]
    if target.kind != "cuda":
        return host
    kernels, launches = _parts(ops, target, bound)
    return max(kernels, launches + host) - max(kernels, launches)


def _parts(ops: list[LoggedOp], target: Target, bound: str) -> tuple[float, float]:
    """(device seconds of `ops`' work, host seconds of their launches) at `bound`."""
    i = BOUNDS[bound]
    eff, beff = target.efficiency[i], target.bandwidth_efficiency[i]
    measured = target.extra.get("rates", {})
    kernels = 0.0
    for op in ops:
        rate = measured.get(op.name)
        if op.kind == "vector":  # no FLOP formula: moves bytes
            took = op.nbytes / ((rate or target.bandwidth) * beff)
        else:
            peak = target.matmul_rate(op.dtype)
            if rate is None or op.dtype != "float32":  # calibrated in fp32
                rate = peak * (target.extra.get("conv", 1.0) if op.kind == "conv" else 1.0)
            took = max(op.flops / (rate * eff), op.nbytes / (target.bandwidth * beff))
        kernels += took
    return kernels, len(ops) * target.overhead[2 - i]


def interval(ops: list[LoggedOp], target: Target) -> tuple[float, float, float]:
    """(fastest, typical, slowest) seconds of `ops` on `target`."""
    return (seconds(ops, target, "fast"), seconds(ops, target, "typical"),
            seconds(ops, target, "slow"))


def backward_interval(ops: list[LoggedOp], out: torch.Tensor, target: Target
                      ) -> tuple[float, float, float]:
    """`interval` of a profiled block's backward, `ops`, less the ops of the unit loss that
    made its output gradient (`unit_loss_ops` of `out`): in a real step that gradient comes
    from the next block."""
    return _less(interval(ops, target), interval(unit_loss_ops(out), target))


def unit_loss_ops(out: torch.Tensor) -> list[LoggedOp]:
    """The ops of the backward of `core.steps.unit_loss` on a tensor like `out`, which a
    block's profiled backward includes and a real step's does not."""
    from rematlab.core.steps import unit_loss
    from rematlab.preflight.roofline import OpLog

    like = torch.empty_like(out, device="meta").requires_grad_()  # costs nothing to run
    loss, log = unit_loss(like), OpLog()
    with log:
        loss.backward()
    return log.ops


def _less(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, float, float]:
    lo, mid, hi = (max(0.0, x - y) for x, y in zip(a, b, strict=True))
    return lo, mid, hi


@dataclass(frozen=True)
class BlockOps:
    """The ops a fake block ran: its forward's, its backward's (None when it ran none) and
    those of the unit loss that backward includes (`unit_loss_ops`). A block's times on any
    target are priced from them (`block_times`), so one fake profile prices every card of
    its kind (`rematlab.preflight.shared`)."""

    fwd: list[LoggedOp]
    bwd: list[LoggedOp] | None
    loss: list[LoggedOp]


def block_times(ops: BlockOps, target: Target) -> dict[str, object]:
    """A profiled block's seconds on `target`, as `remat.block.BlockCost` names them: its
    forward and backward (typical, and the (fastest, slowest) range) and what
    checkpointing it costs of its own (`checkpoint_seconds`)."""
    f_lo, fwd, f_hi = interval(ops.fwd, target)
    b_lo, bwd, b_hi = (_less(interval(ops.bwd, target), interval(ops.loss, target))
                       if ops.bwd is not None else (0.0, 0.0, 0.0))
    c_lo, c_mid, c_hi = (checkpoint_seconds(ops.fwd, target, bound)
                         for bound in ("fast", "typical", "slow"))
    return {"fwd_time": fwd, "bwd_time": bwd, "fwd_range": (f_lo, f_hi),
            "bwd_range": (b_lo, b_hi), "checkpoint_time": c_mid,
            "checkpoint_range": (c_lo, c_hi)}
