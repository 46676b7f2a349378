"""The devices' rates: peak dense throughput (FLOP/s) and memory bandwidth (B/s). GPUs are
read from pre-flight's profiles by device-name part (`preflight.targets.PROFILES`, each
figure cited from its data sheet; dense rates, never the sparsity ones); a CPU is measured, never
assumed, with the interference guard's calibration kernel at the thread count in question
(an assumed per-thread rate read three times the real duration on this machine). One source,
used by the predictor's roofline features and the sweep's duration estimate
(`estimate_seconds`)."""

from __future__ import annotations

import functools

import torch

from rematlab.core import flops as flop_count
from rematlab.core.clocks import WallClock
from rematlab.core.guard import CALIBRATION_FLOPS, Calibration
from rematlab.core.steps import block_step
from rematlab.core.timer import MIN_REPEAT_SECONDS
from rematlab.measurement import zoo
from rematlab.measurement.spec import Spec
from rematlab.preflight.targets import profile_of_device

GPU_DEFAULT = (100e12, 1.0e12)  # an assumption, for a CUDA/ROCm device with no profile
CPU_BANDWIDTH = 20e9


def device_peaks(device_name: str | None, threads: int | None, dtype: str = "float32"
                 ) -> tuple[float, float]:
    """(matmul FLOP/s at `dtype`, B/s) of a device named like 'NVIDIA H100 80GB' (its
    data-sheet profile, `rematlab.preflight.targets`: the one GPU table), or of `threads` CPU
    threads (measured)."""
    name = device_name or ""
    profile = profile_of_device(name)
    if profile is not None:
        return profile.matmul_rate(dtype), profile.bandwidth
    if name.lower().startswith("cuda"):
        return GPU_DEFAULT
    return cpu_flops(threads or torch.get_num_threads()), CPU_BANDWIDTH


@functools.cache  # one measurement per thread count and process
def cpu_flops(threads: int, tries: int = 10) -> float:
    """This machine's dense fp32 rate at `threads` threads: the interference guard's
    calibration kernel, the fastest of `tries` runs (a few milliseconds in all)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernel = Calibration(torch.device("cpu"), WallClock())
        seconds = min(kernel.run() for _ in range(tries))
    finally:
        torch.set_num_threads(previous)
    return CALIBRATION_FLOPS / seconds


def estimate_seconds(specs: list[Spec]) -> float:
    """A rough duration: FLOPs of a step from a meta-device trace at the device's rate
    (`device_peaks`), times the untimed steps a
    measurement runs, plus its repeats of at least `MIN_REPEAT_SECONDS`, plus a fifth of a
    second of set-up per configuration."""

    cache: dict[tuple, float] = {}
    rates: dict[tuple[str, int], float] = {}
    total = 0.0
    for s in specs:
        key = (s.model, s.input, s.input_shape, s.batch)
        if key not in cache:
            with torch.device("meta"):
                model, shape, _ = zoo.resolve(s.model, s.input, s.input_shape)
                x = torch.empty(s.batch, *shape)
                counter = flop_count.counter()
                with counter:
                    block_step(model, x)
            cache[key] = float(counter.get_total_flops())
        threads = s.threads or torch.get_num_threads()
        if (s.device, threads) not in rates:
            rates[s.device, threads] = device_peaks(s.device, threads)[0]
        step = cache[key] * 1.3 / rates[s.device, threads]
        total += step * s.warmup + max(step, MIN_REPEAT_SECONDS) * s.repeats + 0.2
    return total
