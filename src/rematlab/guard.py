"""Timings that survive a busy machine: detect interference, re-measure, flag.

A configuration measured while another job shares the cores (or the GPU) comes out slower
and noisier than it is, and its own figures cannot tell: a slow repeat set may be a slow
configuration. Three signals say it, each cheap:

- *foreign load* (Linux): the CPU time other processes took on this process's CPUs while the
  repeats ran, from `/proc/stat` minus `/proc/self/stat` — the direct evidence;
- *calibration drift*: every repeat starts with the same fixed matrix products, timed with the
  step's clock; their time on a quiet machine is the reference (the fastest they have run on
  this device at this thread count, in this process or the sweep that started it). This is
  the signal on a GPU shared with another process, and where `/proc` is not there;
- *spread*: the step times' IQR over their median.

A repeat set past any threshold was disturbed. The guard then waits, backing off,
and measures the repeats again, at most `retries` times, keeps the least disturbed attempt,
and hands back the evidence — attempts, drift, spread, trusted — that the dataset stores with
every row. Analyses use trusted rows only and say how many they left out (`trusted_only`).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from rematlab.probes import Clock

CALIBRATION_SIZE = 256  # square fp32 matrices: ~34 MFLOP per product, no allocation
CALIBRATION_PRODUCTS = 16
DRIFT = 0.25  # calibration slower than the reference by more than this: disturbed
LOAD = 0.15  # other processes took more than this share of our CPUs' time: disturbed
NOISY = 0.10  # step-time IQR / median above this: too noisy to conclude from
RETRIES = 2
BACKOFF_S = 1.0


class HostLoad:
    """The share of this process's CPUs' time that *other* processes used between `start`
    and `stop`: busy jiffies of those CPUs (`/proc/stat`) less this process's own
    (`/proc/self/stat`, all threads), over their elapsed jiffies. `None` where `/proc` is not
    readable (not Linux)."""

    def __init__(self) -> None:
        self.cpus = {f"cpu{i}" for i in os.sched_getaffinity(0)} if hasattr(
            os, "sched_getaffinity") else set()
        self._start: tuple[int, int, int] | None = None

    def _read(self) -> tuple[int, int, int] | None:
        try:
            with open("/proc/stat", encoding="ascii") as fh:
                lines = [line.split() for line in fh if line.startswith("cpu")]
            with open("/proc/self/stat", encoding="ascii") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        busy = total = 0
        for name, *values in lines:
            if name in self.cpus:
                ticks = [int(v) for v in values]
                total += sum(ticks[:8])  # user .. steal (guest time is inside user)
                busy += sum(ticks[:8]) - ticks[3] - ticks[4]  # less idle and iowait
        return busy, total, int(fields[11]) + int(fields[12])  # own utime + stime

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> float | None:
        end = self._read()
        if self._start is None or end is None or end[1] <= self._start[1]:
            return None
        busy, total, own = (b - a for a, b in zip(self._start, end, strict=True))
        return max(0.0, (busy - own) / total)


class Calibration:
    """The fixed kernel: `CALIBRATION_PRODUCTS` products of two preallocated matrices on the
    measured device, with the thread count the configuration runs at, timed by `clock`."""

    def __init__(self, device: torch.device, clock: Clock) -> None:
        gen = torch.Generator().manual_seed(0)
        self.a = torch.rand(CALIBRATION_SIZE, CALIBRATION_SIZE, generator=gen).to(device)
        self.out = torch.empty_like(self.a)
        self.clock = clock

    def run(self) -> float:
        self.clock.start()
        for _ in range(CALIBRATION_PRODUCTS):
            torch.mm(self.a, self.a, out=self.out)
        return self.clock.stop()


@dataclass
class Attempt:
    """One set of timed repeats: per phase, the mean seconds of each repeat; the steps each
    repeat averaged; the calibration before each; every step's seconds summed."""

    times: dict[str, list[float]] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)
    calibration: list[float] = field(default_factory=list)
    measured_s: float = 0.0
    load: float | None = None  # foreign share of this process's CPUs, when it can be read

    def spread(self) -> float:
        """IQR over median of the step times (0 for fewer than two repeats)."""
        values = self.times.get("step") or []
        if len(values) < 2:
            return 0.0
        q1, median, q3 = np.percentile(values, [25, 50, 75])
        return float((q3 - q1) / median) if median > 0 else 0.0

    def drift(self, reference: float) -> float:
        """How much slower than `reference` the calibration ran (median over repeats)."""
        if not self.calibration or not reference > 0:
            return 0.0
        return statistics.median(self.calibration) / reference - 1.0


@dataclass(frozen=True)
class Evidence:
    """What the guard saw: stored with every row of the configuration."""

    attempts: int
    drift: float
    spread: float
    load: float | None
    trusted: bool
    reference_s: float

    def columns(self) -> dict[str, float | int | bool | None]:
        return {"attempts": self.attempts, "calibration_drift": self.drift,
                "step_spread": self.spread, "foreign_load": self.load,
                "trusted": self.trusted, "calibration_reference_s": self.reference_s}


@dataclass
class Guard:
    """The policy: thresholds, the number of re-measurements and their back-off, and the
    quiet reference known so far (`None`: the fastest calibration this process has seen)."""

    drift: float = DRIFT
    noisy: float = NOISY
    load: float = LOAD
    retries: int = RETRIES
    backoff_s: float = BACKOFF_S
    reference: float | None = None
    sleep: Callable[[float], None] = time.sleep
    host: Callable[[], HostLoad] = HostLoad

    def describe(self) -> str:
        return (f"disturbed when other processes took > {self.load:.0%} of this process's "
                f"CPUs (/proc/stat), or the calibration ({CALIBRATION_PRODUCTS} products of "
                f"{CALIBRATION_SIZE}x{CALIBRATION_SIZE} fp32 matrices, before every repeat) "
                f"ran > {self.drift:.0%} slower than the fastest seen on this device and "
                f"thread count, or the step IQR exceeds {self.noisy:.0%} of the median; "
                f"re-measured up to {self.retries} times with back-off from "
                f"{self.backoff_s:g} s; the least disturbed attempt kept")

    def disturbed(self, attempt: Attempt, reference: float) -> bool:
        return (attempt.drift(reference) > self.drift or attempt.spread() > self.noisy
                or (attempt.load is not None and attempt.load > self.load))

    def _attempt(self, measure: Callable[[], Attempt]) -> Attempt:
        host = self.host()
        host.start()
        attempt = measure()
        attempt.load = host.stop()
        return attempt

    def run(self, measure: Callable[[], Attempt], key: tuple) -> tuple[Attempt, Evidence]:
        """Call `measure` until an attempt is undisturbed or the retries are spent; the
        least disturbed attempt and the evidence. `key` names the calibration's conditions
        (device, threads): references are only compared within one."""
        tries: list[Attempt] = []
        reference = math.inf
        for i in range(self.retries + 1):
            if i:
                self.sleep(self.backoff_s * 2 ** (i - 1))
            tries.append(self._attempt(measure))
            reference = self._reference(key, tries[-1].calibration)
            if not self.disturbed(tries[-1], reference):
                break

        def badness(a: Attempt) -> tuple[bool, float]:
            return self.disturbed(a, reference), a.drift(reference) + a.spread() + (a.load or 0)

        best = min(tries, key=badness)
        return best, Evidence(attempts=len(tries), drift=best.drift(reference),
                              spread=best.spread(), load=best.load,
                              trusted=not self.disturbed(best, reference), reference_s=reference)

    def _reference(self, key: tuple, calibration: list[float]) -> float:
        seen = min([*calibration, _FASTEST.get(key, math.inf),
                    self.reference if self.reference else math.inf])
        _FASTEST[key] = seen
        return seen


# the fastest calibration this process has timed, per (device, threads): a warm sweep worker
# carries it from one configuration to the next
_FASTEST: dict[tuple, float] = {}


def trusted_only(summary: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """The configurations an analysis may use, and how many it left out: `ok` rows the
    guard did not trust are dropped (rows from before the guard, with no evidence, stay)."""
    if "trusted" not in summary.columns:
        return summary, 0
    trusted = summary["trusted"].astype("boolean").fillna(True).astype(bool)
    untrusted = (summary["outcome"] == "ok") & ~trusted
    return summary[~untrusted].reset_index(drop=True), int(untrusted.sum())
