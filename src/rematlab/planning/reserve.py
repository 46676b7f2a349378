"""What a predicted plan's step needs of a GPU target's card: its whole step run on fake
tensors as CUDA dispatches it, and every allocation and free replayed through the caching
allocator (`rematlab.preflight.caching`), so that the *reserved* peak — what the card must
hold, segments and fragmentation included — is stated beside the allocated one.

The user's whole optimizer step runs twice, as a training loop does: the first creates the
optimizer's state (and leaves the allocator's cache as a real first step leaves it), the
second is the one reported. The second step's forward and backward allocate and free what
the first's did, in the same order, so where nothing of the first outlives it but the
gradients (`_again`), their events are replayed under new names rather than run again, and
only the optimizer phase runs: half the fake step's cost. The BLAS workspaces of the two
threads' handles are allocated first (`Target.blas_resident`), and the attention kernels'
scratch is allocated and freed inside their ops (`rematlab.preflight.kernels`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from rematlab.core.batch import Batch, one_tensor, tensors
from rematlab.core.dispatch import OpRecorder
from rematlab.core.probes import LiveTensorTracker
from rematlab.core.recipe import Step
from rematlab.exceptions import ConfigError
from rematlab.plans.plan import Plan
from rematlab.preflight.caching import CachingAllocator
from rematlab.preflight.cards import BLAS_HANDLES
from rematlab.preflight.fake import FakeSession
from rematlab.preflight.kernels import KernelScratch
from rematlab.preflight.shared import model_key, shared
from rematlab.preflight.targets import Target
from rematlab.remat.layers import offloader_of
from rematlab.remat.strategies import RematChain, apply
from rematlab.remat.structure import Structure
from rematlab.remat.tracing import meta_copy


@dataclass(frozen=True)
class CardMemory:
    """A predicted step's peaks on a card: `allocated` (as `max_memory_allocated`) and
    `reserved` (as `max_memory_reserved`), against what the allocator may reserve
    (`capacity`: the card less the CUDA context); `fits` is False when the replay ran out
    even after releasing the cached segments."""

    allocated: int
    reserved: int
    capacity: int
    fits: bool
    host: int = 0  # host bytes an offloading plan pins (its pool), never the card's
    method: str = "fake step replayed through the CUDA caching allocator's rules"


def card_memory(model: nn.Module, st: Structure, batch: Batch, step: Step, chosen: Plan,
                target: Target) -> CardMemory:
    """`chosen`'s step on `target`'s card (module docstring). The step's allocations and
    frees do not depend on which CUDA card it runs on, so inside
    `rematlab.preflight.shared.shared_runs()` they are recorded once and replayed for each
    card's capacity and workspaces."""
    if target.kind != "cuda":
        raise ConfigError(f"reserved memory is a CUDA card's: target {target.name} is a "
                          f"{target.kind}")
    names = {id(m): name for name, m in model.named_modules()}
    key = ("reserved", model_key(model, batch, step), st.kind,
           tuple(names.get(id(b)) for b in st.blocks), chosen.describe())
    return shared(key, lambda: _trace(model, st, batch, step, chosen)).replayed(target)


@dataclass(frozen=True)
class _Trace:
    """A fake step's allocations `(key, bytes)` and frees `(key, None)`, in order: the
    model's and batch's tensors, then (at `blas_at`) the BLAS handles' workspaces, the
    first step, and (from `second_at`) the step reported."""

    events: list[tuple[object, int | None]]
    blas_at: int
    second_at: int
    host: int = 0

    def alloc(self, key: object, nbytes: int) -> None:
        self.events.append((key, nbytes))

    def free(self, key: object) -> None:
        self.events.append((key, None))

    def replayed(self, target: Target) -> CardMemory:
        """The trace through `target`'s caching allocator."""
        allocator = CachingAllocator(capacity=target.usable)

        def play(events: list[tuple[object, int | None]]) -> None:
            for key, nbytes in events:
                if nbytes is None:
                    allocator.free(key)
                else:
                    allocator.alloc(key, nbytes)

        play(self.events[:self.blas_at])
        for handle in range(BLAS_HANDLES):
            allocator.alloc(("blas", handle), target.workspace)
        play(self.events[self.blas_at:self.second_at])
        allocator.peak_allocated = allocator.allocated
        play(self.events[self.second_at:])
        return CardMemory(allocator.peak_allocated, allocator.peak_reserved, target.usable,
                          allocator.fits, self.host)


def _trace(model: nn.Module, st: Structure, batch: Batch, step: Step, chosen: Plan
           ) -> _Trace:
    """`chosen`'s whole step, twice, on fake CUDA tensors, its allocations recorded."""
    session = FakeSession(cuda=True)
    if st.kind == "layers":
        names = {id(m): name for name, m in model.named_modules()}
        planned = apply(meta_copy(model), chosen, blocks=[names[id(b)] for b in st.blocks])
    else:
        planned = RematChain([meta_copy(b) for b in st.blocks], chosen)
        batch = one_tensor(batch)
    trace = _Trace([], 0, 0)
    tracker = LiveTensorTracker()
    tracker.listener = trace
    offloader = offloader_of(planned)
    if offloader is not None:  # its host buffers are not the card's
        offloader.metered_by(tracker)
    with session.active():
        planned.to_empty(device="cpu")
        fake = session.batch(batch)
        tracker.track([*planned.parameters(), *planned.buffers(), *tensors(fake)])
        optimizer = step.make_optimizer(planned.parameters(), cuda=True)
        blas_at = len(trace.events)
        phases = _Phases(trace.events)
        with OpRecorder(KernelScratch(), tracker):
            step.train_step(planned, fake, optimizer=optimizer, readable=False,
                            around=phases.around)
            second_at = len(trace.events)
            again = (_again(phases, blas_at, optimizer) if optimizer is not None
                     and offloader is None and step.set_to_none and not step.scaled else None)
            if again is None:
                step.train_step(planned, fake, optimizer=optimizer, readable=False)
            else:
                trace.events.extend(again[0])
                step.update(planned.parameters(), optimizer, None, readable=False)
                trace.events.extend(again[1])
    tracker.listener = None  # the frees of the run's tensors after the step are not its
    return _Trace(trace.events, blas_at, second_at, tracker.host_peak)


Events = list[tuple[object, int | None]]


class _Phases:
    """Where each phase of a step (`Step.train_step`'s `around`) begins and ends in a
    list of events."""

    def __init__(self, events: Events) -> None:
        self.events = events
        self.spans: dict[str, list[tuple[int, int]]] = {}

    @contextlib.contextmanager
    def around(self, name: str) -> Iterator[None]:
        start = len(self.events)
        yield
        self.spans.setdefault(name, []).append((start, len(self.events)))


def _again(phases: _Phases, start: int, optimizer: torch.optim.Optimizer
           ) -> tuple[Events, Events] | None:
    """The second step's events up to its optimizer phase, and after it, from the first
    step's (module docstring): `zero_grad` frees the first step's gradients, then the
    forwards and backwards allocate and free what they did, each allocation under a new
    name. None where the first step's events cannot stand for the second's: something
    before its first forward, something older freed inside it, or something other than
    the gradients outliving it (a cache made on the first forward)."""
    events = phases.events
    first = phases.spans["forward"][0][0]
    update, after = phases.spans["optimizer"][0]
    body, tail = events[first:update], events[after:]
    if first != start:
        return None
    alive: dict[object, int] = {}
    for key, nbytes in body + tail:
        if nbytes is not None:
            alive[key] = nbytes
        elif alive.pop(key, None) is None:
            return None
    grads = list(dict.fromkeys(id(p.grad.untyped_storage()) for group in
                               optimizer.param_groups for p in group["params"]
                               if p.grad is not None))
    if set(alive) != set(grads):
        return None
    names: dict[object, object] = {}
    made = itertools.count()

    def renamed(part: Events) -> Events:
        out: Events = []
        for key, nbytes in part:
            if nbytes is None:
                out.append((names.pop(key, key), None))
            else:
                names[key] = ("again", next(made))
                out.append((names[key], nbytes))
        return out
    return [(key, None) for key in grads] + renamed(body), renamed(tail)
