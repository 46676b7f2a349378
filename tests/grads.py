"""Gradients under the user's low-precision step, compared as that precision allows.

Under CPU autocast, torch's own checkpointing (`torch.utils.checkpoint`, transformers'
`gradient_checkpointing_enable`) does not give the plain model's gradients bit for bit:
for GPT-2 in fp16 (loss scaled by 2**16, as `GradScaler` starts) the two differ by up to
1.1e-6 in 34 of 77 parameters with every layer checkpointed, and rematlab's plans differ by
the same amounts. So a plan's gradients are held to the plain model's within the autocast
dtype's rounding of the largest gradient, which a wrong recomputation (another dropout mask,
a block run twice or not at all) exceeds by orders of magnitude. fp16 is scaled as users
scale it: unscaled, half its gradients are subnormal and mean nothing."""

import torch

from rematlab.core.batch import call
from rematlab.core.steps import default_loss

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FP16_SCALE = 2.0 ** 16  # torch.amp.GradScaler's initial scale


def step_grads(model, batch, precision: str | None = None, micro_batches: int = 1,
               params=None) -> list[torch.Tensor]:
    """The gradients of `params` (default: `model`'s) after one step's backward under
    `precision`'s autocast, fp16 scaled and unscaled as `GradScaler` does."""
    params = list(params if params is not None else model.parameters())
    for p in params:
        p.grad = None
    dtype = DTYPES.get(precision)
    scale = FP16_SCALE if dtype == torch.float16 else 1.0
    for _ in range(micro_batches):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = default_loss(call(model, batch), batch) / micro_batches
        (loss * scale).backward()
    return [p.grad / scale for p in params]


def assert_grads_match(got: list[torch.Tensor], want: list[torch.Tensor],
                       precision: str | None = None) -> None:
    """`got` equals `want`: exactly in fp32, else within the autocast dtype's unit roundoff
    of each tensor's largest gradient."""
    dtype = DTYPES.get(precision)
    for g, w in zip(got, want, strict=True):
        if dtype is None:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
            continue
        eps = torch.finfo(dtype).eps / 2
        torch.testing.assert_close(g, w, rtol=eps, atol=eps * float(w.abs().max()))
