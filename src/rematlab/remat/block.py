"""One block's costs, the one block profiler of chains and of layers, eager and compiled
(`profile_block`): a tracked forward and backward with the live-tensor tracker, the
saved-tensor recorder, the FLOP counter, and, where they apply, the allocator's trace, the
target's op logs, kernels' scratch and autocast's weight copies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from rematlab.core import flops as flop_count
from rematlab.core.dispatch import OpListener, OpRecorder
from rematlab.core.precision import CastRecorder
from rematlab.core.probes import (
    LiveTensorTracker,
    allocator_trace,
    rounded,
    storage_key,
)
from rematlab.core.steps import Phases, block_step
from rematlab.core.timer import time_block
from rematlab.plans.plan import Option
from rematlab.preflight.fake import is_fake
from rematlab.preflight.kernels import KernelScratch
from rematlab.preflight.pricing import BlockOps, block_times, unit_loss_ops
from rematlab.preflight.roofline import OpLog
from rematlab.preflight.targets import Target
from rematlab.preflight.workspace import Scratch


@dataclass
class BlockCost:
    """One block's costs on one input, as `profile_block` measures them: bytes rounded to
    the allocator's unit, seconds. A chain's costs (`plans.plan.ChainCosts`, which the
    solver reads) are these, block by block, as columns; the fields mean what the columns
    of the same names mean there."""

    x: int  # the input's bytes
    saved: int  # what autograd saves for backward, beyond the input and the output
    keeps_input: bool
    keeps_output: bool
    fwd_mem: int
    rec_mem: int
    bwd_mem: int
    grad: int  # its parameters' gradients
    fwd_time: float
    bwd_time: float
    fwd_flops: float
    cast: int  # autocast's cached weight copies
    params: int
    out: torch.Tensor  # the output, detached: the next block's input
    options: list[Option] = field(default_factory=list)  # op-level menu (`remat.ops`)
    offload: list[Option] = field(default_factory=list)  # its offload options, metered
    # predicted (a target): the times' (fastest, slowest) and checkpointing's own seconds
    fwd_range: tuple[float, float] | None = None
    bwd_range: tuple[float, float] | None = None
    checkpoint_time: float | None = None
    checkpoint_range: tuple[float, float] | None = None
    ops: BlockOps | None = None  # predicted: the ops its times are priced from (any card)

    def priced(self, target: Target) -> BlockCost:
        """This predicted block's costs with its times priced on `target` (its bytes are the
        fake run's, the same on every card of the target's kind)."""
        assert self.ops is not None, "only a predicted block keeps its ops"
        return replace(self, **block_times(self.ops, target))


# what compiling a block changes (`profile_block(compile=True)`): the rest is the eager's
COMPILED_FIELDS = ("saved", "keeps_input", "keeps_output", "fwd_mem", "rec_mem", "bwd_mem",
                   "fwd_time", "bwd_time")


def profile_block(block: nn.Module, x_in: torch.Tensor, repeats: int, unit: int = 1,
                  run: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  others: list[torch.Tensor] | None = None, compile: bool = False,
                  target: Target | None = None) -> BlockCost:
    """Costs of one block on `x_in`, the one block profiler (chains and layers, eager and
    compiled). `run(x)` calls the block and returns its output tensor (a layer of a real model
    takes more arguments and may return a tuple); `others` are those other tensor arguments,
    whose storages are not the block's saved bytes. With `compile`, the block runs under
    `torch.compile` (warmed up first): the live-tensor tracker cannot see inside compiled
    code, so memory comes from the allocator and saved-tensor hooks alone, and FLOPs are
    left to the eager profile. With a `target`, the block is a fake twin
    (`rematlab.preflight`): its times are the roofline's for the ops it ran, as an interval."""
    run = _warmed(run or block, block, x_in) if compile else (run or block)
    tracked = _BlockRun(block, x_in, run, unit, others, compile, target).go()
    # the tracked run above was the warm-up (first kernels, compiled code already warmed)
    fwd_time, bwd_time = time_block(run, x_in, repeats) if repeats else (0.0, 0.0)
    predicted: dict = {}
    if target is not None:
        ops = BlockOps(tracked.logs[0].ops, tracked.logs[1].ops if tracked.bwd_ran else None,
                       unit_loss_ops(tracked.nxt) if tracked.bwd_ran else [])
        predicted = {**block_times(ops, target), "ops": ops}
        fwd_time, bwd_time = predicted.pop("fwd_time"), predicted.pop("bwd_time")
    kin, kout = tracked.kin, tracked.kout
    return BlockCost(
        x=rounded(x_in.element_size() * x_in.numel(), unit),
        saved=sum(v for k, v in tracked.saved.items() if k not in (kin, kout)),
        keeps_input=kin in tracked.saved,
        keeps_output=kout in tracked.saved,
        fwd_mem=tracked.fwd_mem,
        rec_mem=tracked.fwd_mem if compile else min(tracked.fwd_mem, tracked.rec_mem),
        bwd_mem=tracked.bwd_mem,
        grad=sum(rounded(p.numel() * p.element_size(), unit) for p in block.parameters()
                 if p.requires_grad),
        fwd_time=fwd_time,
        bwd_time=bwd_time,
        fwd_flops=float(tracked.flops.get_total_flops()),
        cast=tracked.casts.nbytes if tracked.casts else 0,
        params=sum(rounded(p.numel() * p.element_size(), unit) for p in block.parameters()),
        out=tracked.nxt,
        **predicted,
    )


def _warmed(run: Callable, block: nn.Module, x_in: torch.Tensor) -> Callable:
    """`run` compiled, its forward and backward compiled outside any measurement."""
    run = compiled(run)
    for _ in range(2):
        block_step(run, x_in)
    for p in block.parameters():
        p.grad = None
    return run


class _BlockRun(Phases):
    """One tracked forward and backward of a block (`profile_block`), with every instrument
    around it: the live-storage tracker (not under compile, which it cannot see into), the
    saved-tensor recorder, the FLOP counter, the op logs a target prices, kernels' scratch
    asked of a calibrated device, the allocator's trace on a real device, and autocast's
    weight copies. `go()` runs it and leaves what it saw on the object."""

    def __init__(self, block: nn.Module, x_in: torch.Tensor, run: Callable, unit: int,
                 others: list[torch.Tensor] | None, compile: bool, target: Target | None
                 ) -> None:
        self.block, self.x_in, self.run, self.compile = block, x_in, run, compile
        exclude = frozenset(storage_key(t) for t in others or ())
        self.saved, self._pack = _saved_recorder(block, unit, exclude)
        self.tracker = LiveTensorTracker(unit=unit)
        # parameters, buffers and other arguments exist before the block runs: tracked up
        # front, so that views of them (a Linear's `weight.t()`) are not counted as new memory
        self.tracker.track([x_in, *block.parameters(), *block.buffers(), *(others or ())])
        self.flops = flop_count.counter()
        self.logs = (OpLog(), OpLog()) if target is not None else None
        self._scratch_kind = target.kind if target is not None and target.calibrated else None
        self._cuda = target is not None and target.kind == "cuda"
        real = not (x_in.device.type == "meta" or is_fake(x_in))
        self.allocator = allocator_trace(x_in.device) if real else None
        region = getattr(run, "autocast_dtype", None)  # `Step.in_region`: autocast's dtype
        self.casts = (CastRecorder(block.parameters(), region, unit) if region and not compile
                      else None)  # the weight copies autocast caches
        self.marks: list[int] = []  # the forward's running peak as autograd saves each tensor
        self.fwd_mem = self.rec_mem = self.bwd_mem = 0
        self.bwd_ran = False

    def _around(self, phase: str, i: int) -> contextlib.ExitStack:
        """The instruments of the forward (`i` 0) or the backward (1): the allocator's
        phase, and one op recorder whose listeners charge kernels' scratch before the
        tracker counts the op's outputs."""
        stack = contextlib.ExitStack()
        if self.allocator is not None:
            stack.enter_context(self.allocator.phase(phase))
        listeners: list[OpListener] = []
        if self._scratch_kind is not None:  # kernels' scratch, asked of the device
            listeners.append(Scratch(self._scratch_kind))
        if self._cuda:  # attention kernels' scratch, from their sources
            listeners.append(KernelScratch())
        if not self.compile:
            listeners.append(self.tracker)
        if self.logs is not None:
            listeners.append(self.logs[i])
        if i == 0 and self.casts is not None:
            listeners.append(self.casts)
        if listeners:
            stack.enter_context(OpRecorder(*listeners))
        return stack

    def _pack_marked(self, t: torch.Tensor) -> torch.Tensor:
        self.marks.append(self.tracker.peak)
        return self._pack(t)

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        self._before = self.tracker.live
        with self._around("forward", 0), \
                self.flops if not self.compile else contextlib.nullcontext(), \
                torch.autograd.graph.saved_tensors_hooks(self._pack_marked, lambda t: t):
            yield

    def forwarded(self, out: torch.Tensor) -> None:
        before, tracker = self._before, self.tracker
        self.fwd_mem = tracker.peak - before
        # a recomputation stops once the last saved tensor is made again (torch's early
        # stop), so the ops after it, the output among them, are not run
        self.rec_mem = (self.marks[-1] - before) if self.marks else 0
        self.kin, self.kout = storage_key(self.x_in), storage_key(out)
        self.nxt = out.detach().clone()  # the next block's input, made outside the view
        self.out_bytes = rounded(out.element_size() * out.numel(), tracker.unit)

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        tracker = self.tracker  # `bwd_mem`: the peak above the output gradient
        before_bwd = tracker.live
        tracker.reset_peak()
        with self._around("backward", 1):
            yield
        self.bwd_mem = tracker.peak - before_bwd - self.out_bytes

    def go(self) -> _BlockRun:
        with self.allocator or contextlib.nullcontext():
            self.bwd_ran = block_step(self.run, self.x_in, self)
        if self.allocator is not None:  # kernel workspaces, compiled code: the allocator's
            phases = self.allocator.phases
            if phases["forward"].transient > self.fwd_mem:  # unseen when: assume all of it
                self.fwd_mem = self.rec_mem = phases["forward"].transient
            if "backward" in phases:
                self.bwd_mem = max(self.bwd_mem, phases["backward"].transient - self.out_bytes)
        return self


def _saved_recorder(block: nn.Module, unit: int, exclude: frozenset = frozenset()
                    ) -> tuple[dict, Callable]:
    """A saved-tensor pack hook that records the storages saved for backward, parameters,
    buffers and the storages in `exclude` left out, and the dict it fills (key -> bytes)."""
    params = {storage_key(p) for p in [*block.parameters(), *block.buffers()]} | exclude
    saved: dict[tuple[str, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in params:
            saved[key] = rounded(t.untyped_storage().nbytes(), unit)
        return t

    return saved, pack


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Lift dynamo's per-code-object recompile limit while planning compiles many blocks and
    plans: they share code objects (`Sequential.forward`, `RematChain.forward`), and past the
    limit (8) dynamo silently runs eager, which would be profiled as if compiled."""
    with torch._dynamo.config.patch(recompile_limit=100_000,
                                    accumulated_recompile_limit=100_000):
        yield


def compiled(fn: Callable) -> Callable:
    """`torch.compile` with static shapes: a plan is made for one input shape."""
    return torch.compile(fn, dynamic=False)
