"""Accelerate: the `Step` an `Accelerator` runs, for `rematlab.prepare(..., step=...)`. A
planned model then goes through `accelerator.prepare` and `accelerator.accumulate` as the
plain one does (its class, parameters and forward signature are the same).

What is read: `mixed_precision` (`"bf16"`, `"fp16"` with a GradScaler, `"no"`) and
`gradient_accumulation_steps`; clipping and the optimizer are the loop's own, so they are
given here as they are given to `accelerator.clip_grad_norm_` and the optimizer.
"""

from __future__ import annotations

from typing import Any

from rematlab.core.recipe import Step


def accelerator_step(accelerator: Any, *, optimizer: Any = "momentum",
                     optimizer_kwargs: dict | None = None, clip: float | None = None,
                     **kwargs: Any) -> Step:
    """The `Step` `accelerator` runs (module docstring); other keywords are `Step`'s."""
    return Step(precision=str(accelerator.mixed_precision),
                micro_batches=accelerator.gradient_accumulation_steps, clip=clip,
                optimizer=optimizer, optimizer_kwargs=optimizer_kwargs or {}, **kwargs)
