"""One rank's step under a plan, run for real and metered: what a plan under a parallel layout
is verified by (`rematlab.planning.planner.Planning.measure`).

For each plan, a copy of the user's unsharded model gets the plan (`rematlab.apply`), is
sharded as the layout says (`shard`), and runs the user's step twice with the step's
optimizer: the first makes the optimizer state, the second is metered whole (forward,
backward, clipping, the optimizer's step). Measured, the copy is real and the process group
the job's (every rank runs the same calls, in the same order, and the peak is the largest
rank's, so that every rank makes the same choices). Predicted, the copy is built on the meta
device and made of fake tensors after sharding, on a fake group of N ranks in this process:
the per-rank bytes of N cards without them (`group`).

CPU and fake steps are metered by the sharded live-storage tracker (`meter.RankTracker`);
a CUDA rank by the caching allocator's `max_memory_allocated`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from rematlab.core.batch import Batch, tensors
from rematlab.core.layout import DDP, FSDP
from rematlab.core.recipe import Step
from rematlab.distributed.group import mesh_for
from rematlab.distributed.meter import RankTracker
from rematlab.distributed.shard import shard
from rematlab.plans.plan import Plan
from rematlab.preflight.fake import FakeSession
from rematlab.remat.layers import offloader_of
from rematlab.remat.strategies import apply
from rematlab.remat.tracing import meta_copy

PARAMS, STATE, INPUTS = "parameter shards", "optimizer state", "batch and buffers"
WHOLE = "parameters"  # a DDP rank holds each whole
BUCKETS = "gradient buckets"


@dataclass(frozen=True)
class RankPeak:
    """A plan's per-rank step peak (the largest rank's), what held it at that moment on this
    rank (`breakdown`, bytes by kind; absent on CUDA), and how it was metered."""

    peak: int
    world_size: int
    method: str
    breakdown: dict[str, int] = field(default_factory=dict)


@dataclass
class RankEngine:
    """Runs a plan's sharded step (module docstring). `layers`: the names of the blocks a
    plan's items refer to (None: a chain model, `apply` finds them); `units`: the FSDP
    units' names; `session`: the fake-tensor session of a prediction (None: measured);
    `unit`: the allocator's block size bytes are rounded to; `extra`: bytes resident on
    every rank beyond the step's tensors (a CUDA target's BLAS workspaces)."""

    model: nn.Module
    batch: Batch
    step: Step
    layout: FSDP | DDP
    world_size: int
    units: list[str]
    layers: list[str] | None
    session: FakeSession | None = None
    unit: int = 1
    extra: int = 0
    source: nn.Module | None = None  # where a measured copy's values come from (`fill`)
    results: dict[str, RankPeak] = field(default_factory=dict)

    @property
    def device_type(self) -> str:
        if self.session is not None:
            return "cpu"
        return next(tensors(self.batch)).device.type

    def peak(self, chosen: Plan) -> RankPeak:
        """`chosen`'s per-rank step peak, run once per plan."""
        key = chosen.describe()
        if key not in self.results:
            self.results[key] = self._run(chosen)
        return self.results[key]

    def _run(self, chosen: Plan) -> RankPeak:
        fake = self.session is not None
        with mesh_for(self.world_size, self.device_type, fake) as mesh:
            twin = meta_copy(self.model)  # never a second whole model in memory
            units = [twin.get_submodule(n) for n in self.units]
            planned = apply(twin, chosen, blocks=self.layers)
            fsdp = isinstance(self.layout, FSDP)
            if fake:
                # DDP is not built on fakes: its constructor reads the parameters' values
                # and its reducer's C++ hooks return nothing under fake tensors. Nor is it
                # needed: a DDP rank holds the unsharded step plus the gradient buckets,
                # which `_metered` adds in closed form (`ddp_buckets`)
                if fsdp:
                    planned = shard(planned, units, self.layout, mesh)
                with self.session.active():
                    to_empty(planned, "cpu", tied=not fsdp)
                    return self._metered(planned, self.session.batch(self.batch),
                                         readable=False)
            # FSDP shards first, so that each rank allocates its shards only; DDP broadcasts
            # the parameters as it wraps them, so real ones come first
            if fsdp:
                planned = shard(planned, units, self.layout, mesh)
            to_empty(planned, next(tensors(self.batch)).device, tied=not fsdp)
            fill(planned, self.source or self.model)
            buckets = None
            if not fsdp:
                planned = shard(planned, units, self.layout, mesh)
                buckets = Buckets()
                planned.register_comm_hook(None, buckets.hook)
            return self._metered(planned, self.batch, readable=True, buckets=buckets)

    def _metered(self, model: nn.Module, batch: Batch, readable: bool,
                 buckets: Buckets | None = None) -> RankPeak:
        optimizer = self.step.make_optimizer(
            model.parameters(), cuda=self.session is not None and self.session.cuda)
        # warm-up: the first step makes the optimizer state; DDP's reducer rebuilds its
        # buckets in the order the gradients arrived at the second: the third is the
        # steady step a user's loop repeats. On fakes only the state matters (the meter
        # counts live tensors, not an allocator's history), so the first step is its
        # optimizer phase alone, on gradients shaped as backward leaves them
        if self.session is not None:
            self._state_made(model, optimizer)
        for _ in range(0 if self.session is not None else 2 if buckets is not None else 1):
            self.step.train_step(model, batch, optimizer=optimizer, readable=readable)
        cuda = self.device_type == "cuda"
        if cuda:  # the allocator sees the buckets (resident since the reducer made them)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.step.train_step(model, batch, optimizer=optimizer)
            peak, split, method = torch.cuda.max_memory_allocated(), {}, \
                "torch.cuda.max_memory_allocated"
        else:
            tracker = RankTracker(self.unit)
            tracker.track(model.parameters(),
                          PARAMS if isinstance(self.layout, FSDP) else WHOLE)
            tracker.track(_state(optimizer), STATE)
            tracker.track([*model.buffers(), *tensors(batch)], INPUTS)
            if buckets is not None:
                tracker.track(buckets.tensors(), BUCKETS)
            offloader = offloader_of(model)
            if offloader is not None:  # its host buffers are not the rank's device memory
                offloader.metered_by(tracker)
            with tracker:
                self.step.train_step(model, batch, optimizer=optimizer, readable=readable)
            peak, split, method = tracker.peak, tracker.at_peak, tracker.method
        # resident beyond the tracked tensors: a predicted DDP rank's buckets (no DDP runs
        # there), a CUDA target's BLAS workspaces
        extra = {BUCKETS: ddp_buckets(model) if isinstance(self.layout, DDP)
                 and self.session is not None else 0,
                 "BLAS workspaces": self.extra}
        extra = {k: v for k, v in extra.items() if v}
        peak += sum(extra.values())
        if self.session is None and self.world_size > 1:
            peak = _largest(peak, "cuda" if cuda else "cpu")
        return RankPeak(peak, self.world_size, method, {**split, **extra})

    def _state_made(self, model: nn.Module, optimizer: torch.optim.Optimizer | None
                    ) -> None:
        """A fake rank's first step as the next one sees it: every trainable parameter's
        gradient (a shard like the parameter's under FSDP2) and the optimizer's state, made
        by its update, left alive as a real first step leaves them."""
        trainable = [p for p in model.parameters() if p.requires_grad]
        for p in trainable:
            p.grad = torch.zeros_like(p)
        if optimizer is None:
            return
        scaler = self.step.make_scaler(torch.device("cpu"))
        if scaler is not None:
            scaler.scale(torch.ones(()))  # makes its scale, as a first step's loss does
        self.step.update(trainable, optimizer, scaler, readable=False)


def to_empty(model: nn.Module, device: str | torch.device, tied: bool) -> None:
    """`model.to_empty(device=...)`, and with `tied` its shared parameters shared again:
    torch's `to_empty` gives each module its own copy of a parameter two modules share,
    so a language model's tied embedding and head would be two tensors on the rank. (An
    FSDP2 model is sharded before it is materialised, and keeps its parameters as its
    parameter groups hold them.)"""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    if tied:
        for module in model.modules(remove_duplicate=False):
            for name, p in module.named_parameters(recurse=False):
                places.setdefault(id(p), []).append((module, name))
    model.to_empty(device=device)
    for (first, name), *others in places.values():
        for module, other in others:
            setattr(module, other, getattr(first, name))


class Buckets:
    """torch's default DDP all-reduce as a comm hook (`allreduce_hook`: each bucket divided
    by the world size in place, then summed; the same bytes as the reducer's own path) that
    remembers each bucket's storage. The C++ reducer allocates the buckets where no dispatch
    mode sees them: a CPU rank's meter registers them as resident before the step, rather
    than meeting them halfway through backward. Weak references: a rebuilt bucket's old
    storage goes as it would without the hook."""

    def __init__(self) -> None:
        self._storages: dict[int, weakref.ref] = {}

    # no annotations: DDP checks a hook's against its own types, and here they are strings
    def hook(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self._storages[bucket.index()] = weakref.ref(bucket.buffer().untyped_storage())
        return allreduce_hook(state, bucket)

    def tensors(self) -> list[torch.Tensor]:
        """A tensor on each live bucket's storage (for a tracker to register)."""
        alive = [ref() for ref in self._storages.values()]
        return [torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)
                for s in alive if s is not None]


def ddp_buckets(model: nn.Module) -> int:
    """Bytes of DDP's gradient buckets: the reducer keeps one flat buffer per bucket, which
    together cover every trainable parameter, beside the gradients themselves
    (`gradient_as_bucket_view=False`, torch's default)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def fill(model: nn.Module, source: nn.Module) -> None:
    """Give a measured copy `source`'s values, by name: a sharded source's own shards, this
    rank's shard of an unsharded one (`distribute_tensor` slices it locally, as FSDP2 shards);
    small random weights and zero buffers where the source has no data (a model built on
    the meta device: the bytes, and so the peak, are the same)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    given = {**dict(source.named_parameters()), **dict(source.named_buffers())}
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            local = t.to_local() if isinstance(t, DTensor) else t
            src = given.get(name)
            if src is None or src.is_meta:
                if local.is_floating_point() and isinstance(t, nn.Parameter):
                    local.normal_(0.0, 0.02)
                else:
                    local.zero_()
            elif isinstance(src, DTensor):
                local.copy_(src.to_local())
            elif isinstance(t, DTensor):
                local.copy_(distribute_tensor(src.to(local.device), t.device_mesh, t.placements,
                                              src_data_rank=None).to_local())
            else:
                local.copy_(src)


def _state(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [v for s in optimizer.state.values() for v in s.values()
            if isinstance(v, torch.Tensor)]


def _largest(peak: int, device: str) -> int:
    """The largest peak over the ranks (every rank gets the same answer)."""
    value = torch.tensor([peak], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())

