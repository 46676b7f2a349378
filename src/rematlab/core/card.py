"""What disturbs a step timed on a GPU, read around each timed repeat (issue 51).

On a GPU machine the step runs on the card: the host's other processes do not slow it, so the
CPU rule (`guard.HostLoad`: other processes' share of this process's CPUs) distrusted an idle
16-core H200 machine 14 times in 16. What does slow a GPU step:

- *another process on the card* (its kernels share the SMs, its memory the bandwidth): NVML's
  list of compute processes where `pynvml` is installed (NVIDIA; more than one means another,
  whatever PID namespace we run in), else the card's used memory (`torch.cuda.mem_get_info`,
  any card torch drives, ROCm included) beyond what this process's allocator holds and a
  context's allowance;
- *clocks slowed* by heat or the hardware (NVML's clock-event reasons: thermal slowdown,
  hardware slowdown, power brake; the power cap a busy card runs at is normal, not a
  disturbance);
- *a starved launch thread*: the time this thread waited on a run queue for a CPU
  (`/proc/thread-self/schedstat`), as a share of the repeat's wall time.

`CardLoad` reads them as `HostLoad` reads the host: `start`, then `stop` gives the share that
judges the repeat (1.0 for a card-level disturbance) and `reason` says what it was. Every
reading is optional (`None`: not readable here), and `CardReadings` can be replaced by a fake.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

# Bytes used on the card beyond this process's allocator that still mean "alone": our own CUDA
# context (751-767 MiB measured on an H200, CUDA 13) and libraries' buffers outside the caching
# allocator, with room to spare. A second process holds at least its own context.
CONTEXT_ALLOWANCE = 1280 << 20
# NVML clock-event reasons that slow a kernel abnormally (nvml.h): SW and HW thermal slowdown,
# HW slowdown, HW power brake. The SW power cap and idle are how a card normally runs.
SLOWDOWNS = {0x20: "software thermal slowdown", 0x40: "hardware thermal slowdown",
             0x08: "hardware slowdown", 0x80: "hardware power brake"}


class CardReadings:
    """A card's state: through NVML where `pynvml` is installed, through torch otherwise."""

    def __init__(self, device: torch.device) -> None:
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self._nvml = _nvml_handle(self.index)

    def processes(self) -> int | None:
        """How many processes compute on the card (NVML); None where unknown."""
        if self._nvml is None:
            return None
        nvml, handle = self._nvml
        with contextlib.suppress(Exception):
            return len(nvml.nvmlDeviceGetComputeRunningProcesses(handle))
        return None

    def others_bytes(self) -> int | None:
        """Bytes used on the card beyond this process's allocator and `CONTEXT_ALLOWANCE`."""
        with contextlib.suppress(Exception):
            free, total = torch.cuda.mem_get_info(self.index)
            return max(0, total - free - torch.cuda.memory_reserved(self.index)
                       - CONTEXT_ALLOWANCE)
        return None

    def slowdown(self) -> str | None:
        """Why the card's clocks are slowed abnormally (`SLOWDOWNS`), if they are (NVML)."""
        if self._nvml is None:
            return None
        nvml, handle = self._nvml
        with contextlib.suppress(Exception):
            bits = nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)
            return ", ".join(name for bit, name in SLOWDOWNS.items() if bits & bit) or None
        return None

    def launch_wait(self) -> float | None:
        """Seconds the launching thread has waited for a CPU so far (`thread_wait_s`)."""
        return thread_wait_s()


def _nvml_handle(index: int) -> tuple[Any, Any] | None:
    """NVML and the card's handle, where pynvml is installed and the card is NVIDIA's."""
    try:
        import pynvml
    except ImportError:
        return None
    with contextlib.suppress(Exception):
        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
    return None


def thread_wait_s() -> float | None:
    """Seconds this thread has waited on a run queue for a CPU (Linux schedstat)."""
    with (contextlib.suppress(OSError, ValueError, IndexError),
          open("/proc/thread-self/schedstat", encoding="ascii") as fh):
        return int(fh.read().split()[1]) / 1e9
    return None


class CardLoad:
    """The GPU's rule for one repeat (module docstring): `stop` returns the share that judges
    it — 1.0 when another process is on the card or its clocks are slowed, else the share of
    the repeat the launch thread waited for a CPU; None where nothing is readable — and sets
    `reason` (a wait is a reason above `threshold`)."""

    def __init__(self, readings: CardReadings, threshold: float,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.readings, self.threshold, self.clock = readings, threshold, clock
        self.wait = readings.launch_wait
        self.reason: str | None = None
        self._start: tuple[float | None, float] | None = None

    def start(self) -> None:
        self._start = (self.wait(), self.clock())

    def stop(self) -> float | None:
        share = self._waited()
        reasons = []
        procs = self.readings.processes()
        others = self.readings.others_bytes() if procs is None else None
        if procs is not None and procs > 1:
            reasons.append(f"{procs - 1} other process(es) on the card")
        elif others:
            reasons.append(f"{others >> 20} MiB held on the card by others")
        slowed = self.readings.slowdown()
        if slowed:
            reasons.append(f"clocks slowed: {slowed}")
        card = bool(reasons)
        if share is not None and share > self.threshold:
            reasons.append(f"the launch thread waited {share:.0%} of the repeat for a CPU")
        self.reason = "; ".join(reasons) or None
        if card:
            return 1.0
        if share is not None:
            return share
        return None if procs is None and others is None else 0.0

    def _waited(self) -> float | None:
        """The share of the repeat's wall time this thread waited for a CPU."""
        if self._start is None:
            return None
        waited, began = self._start
        now, wall = self.wait(), self.clock() - began
        if waited is None or now is None or wall <= 0:
            return None
        return max(0.0, (now - waited) / wall)
