"""Clocks: what times a region on each device, swappable so timing logic is testable with a
fake clock (`Clock`)."""

from __future__ import annotations

import time
from typing import Protocol

import torch


class Clock(Protocol):
    """Times a region: `start()` then `stop()` returns seconds, synchronising the device."""

    def start(self) -> None: ...

    def stop(self) -> float: ...


class WallClock:
    """`time.perf_counter` around a region, synchronising CUDA first when given a device."""

    method = "perf_counter"

    def __init__(self, device: torch.device | None = None) -> None:
        self._cuda = device is not None and device.type == "cuda"
        self._t0 = 0.0

    def start(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - self._t0


class CudaEventClock:
    """CUDA events recorded on the current stream; elapsed time after a synchronize."""

    method = "cuda_events"

    def __init__(self) -> None:
        self._begin = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self._begin.record()

    def stop(self) -> float:
        self._end.record()
        self._end.synchronize()
        return self._begin.elapsed_time(self._end) / 1000.0


def clock_for(device: torch.device) -> Clock:
    return CudaEventClock() if device.type == "cuda" else WallClock(device)
