"""The precisions a step is named by, as torch, HF, Accelerate and Lightning name them, and
what each means for the step: an autocast dtype (mixed precision: fp32 weights, the forward's
ops in bf16/fp16), or weights in a dtype of their own with no autocast (Lightning's "-true"
precisions: the module and the batch's floats are converted, `Fabric`'s `HalfPrecision`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

from rematlab.core.batch import Batch, cast
from rematlab.core.dispatch import OpCall, Recorded
from rematlab.core.probes import rounded
from rematlab.exceptions import ConfigError

MIXED = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "bf16-mixed": torch.bfloat16,
         "fp16": torch.float16, "float16": torch.float16, "16-mixed": torch.float16,
         "16": torch.float16}
TRUE = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64,
        "64": torch.float64}
FULL = ("fp32", "float32", "32", "32-true", "no", "none")  # fp32, no autocast


def autocast_dtype(precision: str | torch.dtype | None) -> torch.dtype | None:
    """The autocast dtype of `precision`, None when the step runs without autocast; an
    unknown precision is bad input."""
    p = precision
    if p is None:
        return None
    if isinstance(p, torch.dtype):
        if p in (torch.bfloat16, torch.float16):
            return p
        if p == torch.float32:
            return None
    elif isinstance(p, str) and p.lower() in MIXED:
        return MIXED[p.lower()]
    elif isinstance(p, str) and p.lower() in (*FULL, *TRUE):
        return None
    raise ConfigError(f"unknown precision {p!r}; choose bf16, fp16 or fp32 (mixed: autocast), "
                      "or bf16-true, 16-true, 64-true (the weights in that dtype)")


def weights_dtype(precision: str | torch.dtype | None) -> torch.dtype | None:
    """The dtype a "-true" precision converts the weights to; None for any other."""
    return TRUE.get(precision.lower()) if isinstance(precision, str) else None


def as_trained(model: nn.Module, batch: Batch, dtype: torch.dtype | None
               ) -> tuple[nn.Module, Batch]:
    """The model and batch as a "-true" precision trains them: a copy of the model in
    `dtype` (the user's own is left as it is) and the batch's floats in it; both as they
    are when `dtype` is None or already theirs."""
    if dtype is None:
        return model, batch
    if any(p.dtype != dtype and p.is_floating_point() for p in model.parameters()):
        model = copy.deepcopy(model).to(dtype)
    return model, cast(batch, dtype)


class CastRecorder(Recorded):
    """The bytes of the `dtype` copies autocast makes of `params` while active: the copies
    its weight cache keeps until the autocast region ends (it caches casts of trainable fp32
    leaves only, `autocast_mode.cpp`'s `cached_cast`), each parameter once. Autocast reads
    as disabled below it, where dispatch modes run, so the region's dtype is given."""

    def __init__(self, params: Iterable[torch.Tensor], dtype: torch.dtype, unit: int = 1
                 ) -> None:
        self.unit, self.dtype = unit, dtype
        self._params = {id(p): p for p in params
                        if p.requires_grad and p.dtype == torch.float32}
        self.casts: dict[int, int] = {}

    @property
    def nbytes(self) -> int:
        return sum(self.casts.values())

    def on_op(self, call: OpCall) -> None:
        out, args = call.out, call.args
        if call.func is torch.ops.aten._to_copy.default and args \
                and id(args[0]) in self._params \
                and isinstance(out, torch.Tensor) and out.dtype == self.dtype:
            self.casts.setdefault(id(args[0]),
                                  rounded(out.untyped_storage().nbytes(), self.unit))
