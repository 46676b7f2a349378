"""The roofline's rates measured on a device that is present: this CPU here, a GPU by
`gpu_calibrate` (CUDA events, real layers' GEMMs: host-timed small ops would measure a GPU's
launch latency).

On the CPU, a suite of small training steps — the pieces models are made of: linear layers
with GELU and dropout, layer norm and softmax, attention, convolutions with batch norm, ReLU
and pooling, embeddings and cross-entropy — runs forward and backward under a dispatch mode
that times every aten op. Each op's rate is what it reached: FLOP/s for matmuls,
convolutions and attention, bytes/s for the rest, per op name (the median over the suite's
two sizes and its repeats). An op the suite never ran is priced at its class's median rate.
What a step costs beyond its kernels (Python, autograd, the dispatcher) is the per-op
`overhead`: the suite's wall time less its ops' times, per op. The spread of an op class's
rates is the interval.

Calibration takes seconds; `rematlab.preflight.targets.calibrated` keeps its result on disk.
The machine may be shared: rates are medians of repeats, and a busy machine is said
(`watched`).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from rematlab.core.dispatch import OpCall, OpRecorder
from rematlab.core.steps import block_step
from rematlab.core.timer import watched
from rematlab.preflight.gpu_calibrate import EventTiming, measure_gpu
from rematlab.preflight.roofline import LoggedOp, logged

# of what `measure` reports: a cached calibration of another version is redone (5: a GPU
# target gets its card's BLAS workspace and CUDA context)
VERSION = 5
ROUNDS = 5  # the suite runs this many times after a warm-up; each op's median is kept
SCALES = (1, 4)  # batch multipliers: small and larger kernels
MIN_BYTES = 1 << 16  # an op moving less has no rate to speak of: its time is overhead


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).transpose(1, 3) \
            .unbind(2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2) \
            .reshape(b, s, w)


def _suite(scale: int) -> list[tuple[nn.Module, torch.Tensor]]:
    """(module, input) pairs whose forward and backward exercise the common aten ops."""
    width = 256
    tokens = torch.randn(8 * scale, 64, width)
    pieces = [
        (nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                       nn.Linear(4 * width, width), nn.Dropout(0.1)), tokens),
        (nn.Sequential(nn.LayerNorm(width), _Attention(width, 4), nn.Softmax(-1)), tokens),
        (nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                       nn.MaxPool2d(2), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(inplace=True),
                       nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(512, 10),
                       nn.LogSoftmax(-1)), torch.randn(4 * scale, 16, 32, 32)),
        (nn.Sequential(nn.Embedding(4096, width), nn.SiLU(), nn.Linear(width, 4096),
                       nn.LogSoftmax(-1)), torch.randint(0, 4096, (4 * scale, 64))),
    ]
    return pieces


class _OpTimes:
    """Seconds inside every op, beside the op's log (the CPU runs an op as it is called): an
    `OpRecorder` listener, the recorder timing on the host."""

    def __init__(self) -> None:
        self.ops: list[LoggedOp] = []
        self.seconds: list[float] = []

    def on_op(self, call: OpCall) -> None:
        op = logged(call)
        if op is not None:
            self.ops.append(op)
            self.seconds.append(call.seconds)


def measure(kind: str = "cpu") -> dict:
    """The fields of a `rematlab.preflight.targets.Target` for this machine's CPU (see module
    docstring), or the GPU here (`gpu_calibrate`: events, real layers' GEMMs)."""
    if kind == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        return measure_gpu(device, EventTiming(), torch.cuda.mem_get_info(device)[1])
    samples: dict[str, list[tuple[str, float]]] = defaultdict(list)
    walls, kernels, counts = [], [], []
    with watched("the roofline's calibration kernels"):
        for scale in SCALES:
            for module, x in _suite(scale):
                block_step(module, x)  # warm-up
                for _ in range(ROUNDS):
                    timer = _OpTimes()
                    with OpRecorder(timer, timing="host"):
                        block_step(module, x)
                    t0 = time.perf_counter()
                    block_step(module, x)
                    walls.append(time.perf_counter() - t0)
                    kernels.append(sum(timer.seconds))
                    counts.append(len(timer.seconds))
                    for op, took in zip(timer.ops, timer.seconds, strict=True):
                        if op.nbytes >= MIN_BYTES:  # a tiny op's time is all fixed cost
                            samples[op.name].append((op.kind, (op.flops or op.nbytes) / took))
        low = _matmul_rate(torch.bfloat16)
        per_checkpoint = _checkpoint_seconds(_suite(1))
    overhead = max(0.0, statistics.median((w - k) / n for w, k, n in
                                          zip(walls, kernels, counts, strict=True)))
    rates = {name: statistics.median(r for _, r in rows) for name, rows in samples.items()}
    mm32 = [rates[n] for n, rows in samples.items() if rows[0][0] == "matmul"]
    moves = [rates[n] for n, rows in samples.items() if rows[0][0] == "vector"]
    memory = _host_memory()
    return dict(
        name=kind, kind="cpu", memory=memory,
        flops={"float32": statistics.median(mm32), "bfloat16": low, "float16": low},
        bandwidth=statistics.median(moves),
        overhead=(overhead / 2, overhead, 2 * overhead),
        efficiency=_spread(mm32), bandwidth_efficiency=_spread(moves),
        source=f"measured on this machine ({torch.get_num_threads()} threads, torch "
               f"{torch.__version__})",
        calibrated=True, extra={"rates": rates, "checkpoint": per_checkpoint})


def _checkpoint_seconds(pieces: list[tuple[nn.Module, torch.Tensor]]) -> float:
    """Seconds that checkpointing a piece adds to its step beyond running its forward again:
    checkpointing's own work (saved-tensor hooks, the RNG state, the recomputation on a cold
    cache). The median over the suite's pieces, never below 0."""
    extra = []
    for module, x in pieces:
        plain = _median_seconds(lambda m=module, x=x: block_step(m, x))
        ckpt = _median_seconds(lambda m=module, x=x: block_step(
            lambda v: checkpoint(m, v, use_reentrant=False), x))
        extra.append(ckpt - plain - _median_seconds(lambda m=module, x=x: m(x)))
    return max(0.0, statistics.median(extra))


def _median_seconds(fn: Callable[[], object]) -> float:
    fn()
    times = []
    for _ in range(2 * ROUNDS + 1):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _matmul_rate(dtype: torch.dtype) -> float:
    """FLOP/s of a 256-square matmul in `dtype` (the suite runs fp32; a CPU without native
    bf16 runs bf16 matmuls far slower, which a plan in bf16 must know)."""
    a = torch.randn(256, 256).to(dtype)
    return 2 * 256 ** 3 / _median_seconds(lambda: a @ a)


def _spread(rates: list[float]) -> tuple[float, float, float]:
    """(slowest, typical, fastest) as fractions of the median rate, the extremes pulled in
    to the quartiles: one odd op should not widen every interval."""
    qs = statistics.quantiles(rates, n=4) if len(rates) > 1 else [rates[0]] * 3
    mid = statistics.median(rates)
    return (qs[0] / mid, 1.0, qs[2] / mid)


def _host_memory() -> int:
    """This machine's RAM, from /proc/meminfo (what a CPU plan can at most use)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
