"""The ops a CUDA step dispatches, run on CPU fake tensors: how pre-flight prices a CUDA target.

Fake CUDA tensors cannot go through autograd on a build without CUDA: the process aborts in
C++ ("PyTorch is not linked with support for cuda devices"), with no exception to catch. So no
fake CUDA tensor is made at all; a CUDA target's step runs on CPU fake tensors, and
`CudaDispatch`, a `TorchFunctionMode`, routes the functions whose CUDA kernels differ from the
CPU's to the aten ops CUDA's dispatch picks. Each has a fake implementation and an autograd
formula, so its saved tensors are the CUDA kernel's:

- `F.dropout`: torch's `dropout` (`aten/src/ATen/native/Dropout.cpp`) takes the fused
  `native_dropout` when `is_fused_kernel_acceptable` holds — a CUDA input, 0 < p < 1, at
  least one element — and saves its **bool** mask; the CPU path (`bernoulli_`, `div_`, `mul`)
  saves a mask in the input's dtype.
- `F.scaled_dot_product_attention`: CUDA's `select_sdp_backend` (`transformers/cuda/
  sdp_utils.cpp`) tries flash attention first — half precision, no mask, head size up to 256
  (grouped-query heads native) — then the memory-efficient kernel, which takes an additive
  mask (a boolean one converted to the query's dtype, `convert_boolean_attn_mask`) and, here,
  key and value expanded to the query's heads. Both save the inputs, the output and a
  log-sum-exp (and the RNG state with dropout), not the probabilities.

A mode is off while its own handler runs and while `backward()` runs, so a recomputation
inside backward would not see it: rematlab's checkpoint regions re-enter the active one around
their recomputation (`active` / `reentered`, read by `rematlab.remat.recompute`). Unlike a
patch of `torch.nn.functional`, the mode is per thread and catches every import of the
functions (`from torch.nn.functional import scaled_dot_product_attention` included).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_ACTIVE: contextvars.ContextVar[CudaDispatch | None] = contextvars.ContextVar(
    "rematlab_cuda_dispatch", default=None)
FLASH_MAX_HEAD = 256  # sdp_utils.cpp: check_head_dim_size_flash


class CudaDispatch(TorchFunctionMode):
    """Routes dropout and attention to the aten ops CUDA dispatches (module docstring)."""

    def __enter__(self) -> CudaDispatch:
        self._token = _ACTIVE.set(self)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        _ACTIVE.reset(self._token)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            return _dropout(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return _attention(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def reentered() -> Iterator[None]:
    """The active `CudaDispatch` again, around a recomputation that backward runs (a fresh
    mode: the active one is off there); nothing when none is active."""
    if _ACTIVE.get() is None:
        yield
        return
    with CudaDispatch():
        yield


def _dropout(input: torch.Tensor, p: float = 0.5, training: bool = True,
             inplace: bool = False) -> torch.Tensor:
    if not (training and 0 < p < 1 and input.numel() > 0):
        return F.dropout(input, p, training, inplace)
    out = torch.ops.aten.native_dropout(input, p, True)[0]
    return input.copy_(out) if inplace else out


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> Any:
    half = query.dtype in (torch.float16, torch.bfloat16)
    if attn_mask is None and half and query.shape[-1] <= FLASH_MAX_HEAD:
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, scale=scale)[0]
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    bias = attn_mask
    if bias is not None and bias.dtype == torch.bool:
        bias = torch.zeros_like(bias, dtype=query.dtype).masked_fill(~bias, float("-inf"))
    if bias is not None:
        bias = bias.expand(*query.shape[:-1], key.shape[-2])
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, True, dropout_p, is_causal, scale=scale)[0]
