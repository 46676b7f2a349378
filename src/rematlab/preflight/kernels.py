"""Scratch that CUDA's attention kernels allocate inside their backward op, which no tensor the
op returns holds, so fake tensors never see it: charged to a CUDA target's live-tensor tracker
at the op, from the kernels' sources (torch 2.13, `aten/src/ATen/native/transformers/cuda/`).

- **Flash attention backward** (`flash_attn/flash_api.cpp`, `mha_bwd`): `softmax_d`, fp32
  `[b, h, round(s_q, 128)]`; `dq_accum`, fp32 `[b, round(s_q, 128), h, d_r]` with the head
  size rounded to 32 (up to 128) or 64 (`head_size_rounded`); and under grouped-query
  attention (fewer key/value heads) `dk_expanded` and `dv_expanded`, `[b, s_k, h, d]` in the
  inputs' dtype, summed into the real gradients at the end. The wrapper
  (`attention_backward.cu`, `_flash_attention_backward`) copies the output gradient when its
  layout is not contiguous.
- **Memory-efficient attention backward** (`attention_backward.cu`,
  `_efficient_attention_backward`, and `mem_eff_attention/kernel_backward.h`, the kernels
  of sm80 and later): the output gradient made contiguous; `delta`, fp32 `[b, h, s_q]`
  (in half precision the kernel computes it; in fp32 torch computes it as
  `(grad_out * out).sum(-1)`, whose fp32 product `[b, s_q, h, d]` is transient too); and the
  kernel's `workspace` (`workspace_size`): fp32 accumulators of the query gradient, one
  `kBlockSizeI x kN` tile per block of 64 queries and 64 head columns (`GradQTempStorage`),
  and for head sizes above 128, where the key/value gradients no longer fit in registers
  (`kOutputInRF`), fp32 accumulators of those too. The key-splitting heuristic is taken at
  one split (it keeps one where a staging area is needed, `attention_backward.cu`); more
  splits only multiply the key/value accumulators.

Each is freed when the op returns: the charge is the op's gradients and its scratch above
what is live before it, as `rematlab.preflight.workspace.Scratch` charges a measured one.
"""

from __future__ import annotations

import torch

from rematlab.core.dispatch import OpCall
from rematlab.preflight.allocator import block

FP32 = 4
FLASH_BACKWARD = "_scaled_dot_product_flash_attention_backward"
EFFICIENT_BACKWARD = "_scaled_dot_product_efficient_attention_backward"
EFFICIENT_TILE = 64  # kBlockSizeI and MatmulGradQ's kN of the sm80+ backward kernels
EFFICIENT_RF_HEAD = 128  # largest head size whose key/value gradients stay in registers


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


def _transposed_copy(t: torch.Tensor) -> int:
    """Bytes of the contiguous copy a kernel makes of `t` ([b, h, s, d]) once transposed to
    [b, s, h, d], if it is not already laid out so."""
    return 0 if t.transpose(1, 2).is_contiguous() else block(t.numel() * t.element_size())


def flash_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor
                   ) -> list[int]:
    """The blocks flash attention's backward allocates beyond its gradients (module
    docstring); tensors in SDPA's [batch, heads, sequence, head size] layout."""
    b, h, s_q, d = query.shape
    s_k, h_k = key.shape[2], key.shape[1]
    d_r = _up(_up(d, 8), 32 if _up(d, 8) <= 128 else 64)
    s_r = _up(s_q, 128)
    scratch = [_transposed_copy(grad_out), block(b * h * s_r * FP32),
               block(b * s_r * h * d_r * FP32)]
    if h_k != h:  # grouped-query attention: key and value gradients at the query's heads
        scratch += 2 * [block(b * s_k * h * d * query.element_size())]
    return scratch


def efficient_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor
                       ) -> list[int]:
    """The blocks the memory-efficient kernel's backward allocates beyond its gradients
    (module docstring)."""
    b, h, s_q, d = query.shape
    s_k = key.shape[2]
    half = query.dtype in (torch.float16, torch.bfloat16)
    scratch = [_transposed_copy(grad_out), block(b * h * s_q * FP32)]
    if not half:  # torch computes delta itself: (grad_out * out) in fp32 first
        scratch.append(block(b * s_q * h * d * FP32))
    tiles = _up(s_q, EFFICIENT_TILE) * _up(d, EFFICIENT_TILE)
    kv = 2 * _up(s_k, EFFICIENT_TILE) * _up(d, EFFICIENT_TILE) if d > EFFICIENT_RF_HEAD else 0
    scratch.append(block(b * h * _up(tiles + kv, 4) * FP32))
    return scratch


class KernelScratch:
    """An `OpRecorder` listener that charges the attention backward kernels' scratch (module
    docstring) to the call, for the live-storage meter listed after it."""

    def on_op(self, call: OpCall) -> None:
        if call.name not in (FLASH_BACKWARD, EFFICIENT_BACKWARD):
            return
        grad_out, query, key = call.args[:3]
        scratch = (flash_backward if call.name == FLASH_BACKWARD else efficient_backward)(
            grad_out, query, key)
        storages = {id(t.untyped_storage()): t.untyped_storage() for t in call.outs}
        grads = sum(block(s.nbytes()) for s in storages.values())  # allocated first
        call.transient = max(call.transient, grads + sum(scratch))
        call.scratch = scratch
