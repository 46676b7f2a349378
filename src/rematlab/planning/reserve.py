"""What a predicted plan's step needs of a GPU target's card: its whole step run on fake
tensors as CUDA dispatches it, and every allocation and free replayed through the caching
allocator (`rematlab.preflight.caching`), so that the *reserved* peak — what the card must
hold, segments and fragmentation included — is stated beside the allocated one.

The user's whole optimizer step runs twice, as a training loop does: the first creates the
optimizer's state (and leaves the allocator's cache as a real first step leaves it), the
second is the one reported. The BLAS workspaces of the two threads' handles are allocated
first (`Target.blas_resident`), and the attention kernels' scratch is allocated and freed
inside their ops (`rematlab.preflight.kernels`).
"""

from __future__ import annotations

from dataclasses import dataclass

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
from rematlab.preflight.targets import Target
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
    method: str = "fake step replayed through the CUDA caching allocator's rules"


def card_memory(model: nn.Module, st: Structure, batch: Batch, step: Step, chosen: Plan,
                target: Target) -> CardMemory:
    """`chosen`'s step on `target`'s card (module docstring)."""
    if target.kind != "cuda":
        raise ConfigError(f"reserved memory is a CUDA card's: target {target.name} is a "
                          f"{target.kind}")
    session = FakeSession(cuda=True)
    if st.kind == "layers":
        names = {id(m): name for name, m in model.named_modules()}
        planned = apply(meta_copy(model), chosen, blocks=[names[id(b)] for b in st.blocks])
    else:
        planned = RematChain([meta_copy(b) for b in st.blocks], chosen)
        batch = one_tensor(batch)
    allocator = CachingAllocator(capacity=target.usable)
    tracker = LiveTensorTracker(unit=target.unit)
    tracker.listener = allocator
    with session.active():
        planned.to_empty(device="cpu")
        fake = session.batch(batch)
        tracker.track([*planned.parameters(), *planned.buffers(), *tensors(fake)])
        for handle in range(BLAS_HANDLES):
            allocator.alloc(("blas", handle), target.workspace)
        optimizer = step.make_optimizer(planned.parameters(), cuda=True)
        with OpRecorder(KernelScratch(), tracker):
            step.train_step(planned, fake, optimizer=optimizer, readable=False)
            allocator.peak_allocated = allocator.allocated
            step.train_step(planned, fake, optimizer=optimizer, readable=False)
    return CardMemory(allocator.peak_allocated, allocator.peak_reserved, target.usable,
                      allocator.fits)
