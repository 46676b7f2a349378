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
- Autocast: the step's autocast region runs on CPU fake tensors, so the dispatcher applies
  the CPU's cast policy, which is not CUDA's (`aten/src/ATen/autocast_mode.cpp`:
  `AT_FORALL_FP32`, `AT_FORALL_FP32_SET_OPT_DTYPE`, `AT_FORALL_LOWER_PRECISION_FP` for
  CUDA, the `KERNEL_CPU` lists for the CPU). On CUDA, `pow`, `softmax`, `layer_norm`, `exp`,
  `sum`, the losses and more run in fp32; the CPU runs them in the input's dtype. So a
  GPT-2 layer's tanh-GELU (`torch.pow` inside) and its eager attention's softmax keep fp32
  tensors for backward on the card and bf16 ones on the CPU: pre-flight was 10-20 % under
  the H200's measured peak (`tests/data/gpu/`). Inside an autocast region the mode applies
  CUDA's policy to the functions whose policy differs (`CUDA_FP32`, `CUDA_FP32_DTYPE`,
  `CUDA_LOW`) and runs the CPU-only ones (`CPU_ONLY`) with the CPU's autocast off, as CUDA
  runs them in their inputs' dtype. The casts are ordinary differentiable ops, recorded by
  autograd before the function, as autocast's own are. The `promote` lists are left to
  type promotion, which gives those ops the same result dtype.

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

# CUDA's autocast policy where it differs from the CPU's, by the Python name of the function
# (`torch.pow`, `Tensor.pow` and `**` are all "pow"); from `autocast_mode.cpp` (module docstring)
CUDA_FP32 = frozenset((
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "__rpow__", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "frobenius_norm", "nuclear_norm", "norm",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp",
    # composite on CUDA: log_softmax (fp32 out) then nll_loss (fp32), as fp32 as a whole
    "cross_entropy"))
CUDA_FP32_DTYPE = frozenset((  # fp32_set_opt_dtype: the output dtype, unless one is given
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum", "vector_norm",
    "matrix_norm"))
CUDA_LOW = frozenset((  # lower precision on CUDA, not in the CPU's list
    "addmv", "addr", "einsum", "mv", "chain_matmul", "multi_dot", "convolution",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"))
CPU_ONLY = frozenset((  # in the CPU's fp32 list only: CUDA runs them in their inputs' dtype
    "avg_pool3d", "max_pool3d", "adaptive_avg_pool3d", "adaptive_max_pool3d",
    "fractional_max_pool2d", "fractional_max_pool3d", "max_unpool2d", "max_unpool3d", "pad",
    "grid_sample", "quantile", "nanquantile", "trace"))
POLICED = CUDA_FP32 | CUDA_FP32_DTYPE | CUDA_LOW | CPU_ONLY


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
            low = low_precision()
            return _attention(*_cast(args, low), **_cast(kwargs, low))
        low = low_precision()
        if low is not None:
            name = getattr(func, "__name__", "")
            if name in POLICED:
                args, kwargs = _cuda_policy(name, args, kwargs, low)
                with torch.autocast("cpu", enabled=False):
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


def low_precision() -> torch.dtype | None:
    """The autocast dtype of the step's region (on the CPU fake tensors run on), or None
    outside autocast."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


def _cuda_policy(name: str, args: tuple, kwargs: dict, low: torch.dtype
                 ) -> tuple[tuple, dict]:
    """`args` and `kwargs` as CUDA's autocast hands them to the function `name`: floating
    tensors cast to fp32 (`fp32`), to `low` (`lower_precision_fp`), or an fp32 output dtype
    when none is given and the first argument is eligible (`fp32_set_opt_dtype`)."""
    if name in CUDA_FP32_DTYPE:
        first = args[0] if args else None
        positional_dtype = name in ("softmax", "log_softmax") and len(args) > 3
        if (_eligible(first) and kwargs.get("dtype") is None and not positional_dtype):
            kwargs = {**kwargs, "dtype": torch.float32}
        return args, kwargs
    if name in CUDA_FP32:
        return _cast(args, torch.float32), _cast(kwargs, torch.float32)
    if name in CUDA_LOW:
        return _cast(args, low), _cast(kwargs, low)
    return args, kwargs


def _eligible(t: object) -> bool:
    """What autocast casts (`is_eligible`): a floating tensor that is not float64."""
    return (isinstance(t, torch.Tensor) and t.is_floating_point()
            and t.dtype != torch.float64)


def _cast(value: Any, dtype: torch.dtype | None) -> Any:
    """`value` with every eligible tensor in it (lists, tuples and dicts' values too) cast
    to `dtype`."""
    if dtype is None:
        return value
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value.to(dtype) if _eligible(value) and value.dtype != dtype else value


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
