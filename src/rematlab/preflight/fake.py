"""Models and batches made of fake tensors: shapes, dtypes and storage sizes without data.

A fake tensor (`torch._subclasses.FakeTensorMode`) runs every op's shape logic and nothing
else, on the device it claims: on "cpu" the dispatcher picks the kernels a real CPU step runs
(its fused attention, its saved tensors), which a meta tensor does not (meta attention runs
the unfused math path and saves the probabilities). Autograd, saved-tensor hooks and dispatch
modes see fake tensors as real ones, so the profilers that measure a block
(`rematlab.remat.block.profile_block`) measure its fake twin byte for byte.

`fake_copy` turns a model — real, or built on the meta device so that its weights were never
allocated — into a fake twin sharing no storage with it. A batch may be real tensors or meta
tensors (shapes only); it becomes fake likewise.

CUDA cannot be faked through autograd on a build without CUDA (the process aborts in C++). A
CUDA target is profiled as CPU fake tensors running the ops CUDA's dispatch would choose
(`rematlab.preflight.cuda_ops.CudaDispatch`): `native_dropout`, the fused attention kernels.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from rematlab.core.batch import Batch, map_tensors
from rematlab.preflight.cuda_ops import CudaDispatch


def is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor)


class FakeSession:
    """A fake-tensor mode and what was made fake in it (see module docstring). Enter it
    around everything that runs the fake twins; `cuda` runs the ops CUDA would
    (`rematlab.preflight.cuda_ops`)."""

    def __init__(self, cuda: bool = False) -> None:
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.cuda = cuda

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Fake mode on. A meta kernel that refuses its inputs raises (a batch the model
        cannot take is said in one line by the caller); torch also logs it as an error with a
        traceback, which is silenced here."""
        noisy = logging.getLogger("torch._subclasses.fake_tensor")
        level = noisy.level
        noisy.setLevel(logging.CRITICAL)
        try:
            with self.mode, (CudaDispatch() if self.cuda else contextlib.nullcontext()):
                yield
        finally:
            noisy.setLevel(level)

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A fake tensor shaped like `t` (real or meta) on the CPU."""
        with self.mode:
            fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
        if isinstance(t, nn.Parameter):
            return nn.Parameter(fake, requires_grad=t.requires_grad)
        return fake.requires_grad_(t.requires_grad) if t.is_floating_point() else fake

    def batch(self, batch: Batch) -> Batch:
        """The batch's fake twin; one tensor given twice (labels that are the input ids)
        stays one."""
        made: dict[int, torch.Tensor] = {}

        def one(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in made:
                made[id(t)] = self.tensor(t)
            return made[id(t)]
        return map_tensors(one, batch)

    def model(self, module: nn.Module) -> nn.Module:
        """`module`'s fake twin (`twin`)."""
        return twin(module, self.tensor)


def twin(module: nn.Module, make: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """A deep copy of `module` whose every parameter, buffer and tensor attribute is
    `make(t)` (a fake or a meta tensor; tied weights stay tied), the rest deep-copied."""
    memo: dict[int, Any] = {}
    for t in [*module.parameters(), *module.buffers(), *_tensor_attributes(module)]:
        if id(t) not in memo:
            memo[id(t)] = make(t)
    return copy.deepcopy(module, memo)


def _tensor_attributes(module: nn.Module) -> Iterator[torch.Tensor]:
    """Plain tensors held as module attributes (caches of rotary tables, masks)."""
    for m in module.modules():
        for value in vars(m).values():
            if isinstance(value, torch.Tensor):
                yield value
