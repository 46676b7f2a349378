"""A GPU's roofline rates, measured the way a GPU runs a training step.

The CPU calibration (`calibrate.measure`) times every op of a suite of small steps with a host
clock and a synchronisation around each op. On a GPU that measures launch latency, not
kernels: a 256-wide matmul finishes before the host has returned from launching it, and an
H100 would be rated far below its peak. So a GPU is measured apart:

- **CUDA events** recorded on the stream around the work, elapsed time read after the end
  event completes (`EventTiming`); the median of `REPEATS` after a warm-up;
- **GEMMs of real layers** (`GEMMS`: 4096 tokens through 4096- and 14336-wide projections,
  Llama-3-8B's), in bf16, fp16 and fp32 (TF32 off, torch's default): FLOP/s per dtype, their
  spread over the shapes the efficiency interval;
- **bandwidth from large copies**: a 1 GiB device-to-device copy reads and writes it;
- **launch overhead from a chain of tiny kernels**: `SMALL_OPS` one-element adds launched
  back to back, where the device waits on the host; per op, what a step pays when it is
  launch-bound;
- **checkpointing's own cost**: a 4096-wide MLP block's step checkpointed, less the same step
  plain, less one forward (what remains is the hooks, the RNG state and the cold recompute).

Timing is a parameter, so the arithmetic is tested with a fake clock on the meta device
(`tests/test_calibrate.py`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rematlab.core.clocks import CudaEventClock
from rematlab.core.steps import block_step

REPEATS = 10
GEMMS = ((4096, 4096, 4096), (4096, 4096, 14336), (4096, 14336, 4096))  # (tokens, in, out)
COPY_BYTES = 1 << 30
SMALL_OPS = 1000
MLP = (4096, 4096)  # (tokens, width) of the block whose checkpointing is timed


class Timing(Protocol):
    """Seconds of `fn`'s work on the device: the median of repeats after a warm-up."""

    method: str

    def seconds(self, fn: Callable[[], object]) -> float: ...


class EventTiming:
    """`fn`'s median seconds by the device's clock (`core.clocks.CudaEventClock`: events on
    the current stream) over `repeats`, after a warm-up (module docstring)."""

    method = CudaEventClock.method

    def __init__(self, repeats: int = REPEATS) -> None:
        self.repeats = repeats

    def seconds(self, fn: Callable[[], object]) -> float:
        fn()  # warm-up: cuBLAS heuristics, allocator blocks
        clock = CudaEventClock()
        times = []
        for _ in range(self.repeats):
            clock.start()
            fn()
            times.append(clock.stop())
        return statistics.median(times)


def measure_gpu(device: torch.device, timing: Timing, memory: int, name: str = "cuda",
                gemms: tuple[tuple[int, int, int], ...] = GEMMS, copy_bytes: int = COPY_BYTES,
                small_ops: int = SMALL_OPS, mlp: tuple[int, int] = MLP) -> dict:
    """The fields of a `rematlab.preflight.targets.Target` for the GPU `device` (module
    docstring); `memory`: the card's bytes as torch reports them (`mem_get_info`)."""
    flops, spread = {}, []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        rates = [_gemm_rate(device, dtype, shape, timing) for shape in gemms]
        flops[str(dtype).removeprefix("torch.")] = statistics.median(rates)
        spread += [r / statistics.median(rates) for r in rates]
    bandwidth = _copy_rate(device, copy_bytes, timing)
    one = torch.zeros(1, device=device)
    launch = timing.seconds(lambda: [one.add_(1) for _ in range(small_ops)]) / small_ops
    return dict(
        name=name, kind="cuda", memory=memory, flops=flops, bandwidth=bandwidth,
        overhead=(launch / 2, launch, 2 * launch),
        # a large copy is the best case of bandwidth; kernels reach less (an assumption)
        efficiency=(min(spread), 1.0, max(spread)), bandwidth_efficiency=(0.9, 1.0, 1.0),
        source=f"measured on this GPU by {timing.method} (GEMMs {list(gemms)}, a "
               f"{copy_bytes >> 20} MiB copy, {small_ops} tiny kernels; torch "
               f"{torch.__version__})",
        calibrated=True,
        extra={"rates": {}, "checkpoint": checkpoint_seconds(device, timing, *mlp)})


def _copy_rate(device: torch.device, nbytes: int, timing: Timing) -> float:
    """Bytes/s of a device-to-device copy of `nbytes`: it reads and writes them."""
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timing.seconds(lambda: dst.copy_(src))


def _gemm_rate(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int],
               timing: Timing) -> float:
    m, k, n = shape
    a = torch.empty(m, k, device=device, dtype=dtype)
    b = torch.empty(k, n, device=device, dtype=dtype)
    return 2 * m * k * n / timing.seconds(lambda: a @ b)


def checkpoint_seconds(device: torch.device, timing: Timing, tokens: int, width: int
                       ) -> float:
    """What checkpointing an MLP block adds to its step beyond its forward run again (module
    docstring), never below 0."""
    w1 = torch.empty(width, 4 * width, device=device, dtype=torch.bfloat16,
                     requires_grad=True)
    w2 = torch.empty(4 * width, width, device=device, dtype=torch.bfloat16,
                     requires_grad=True)
    x = torch.empty(tokens, width, device=device, dtype=torch.bfloat16, requires_grad=True)

    def block(v: torch.Tensor) -> torch.Tensor:
        return F.gelu(v @ w1) @ w2

    plain = timing.seconds(lambda: block_step(block, x))
    kept = timing.seconds(lambda: block_step(
        lambda v: checkpoint(block, v, use_reentrant=False), x))
    return max(0.0, kept - plain - timing.seconds(lambda: block(x)))
