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

That is the CPU's rule. A CUDA configuration is judged by the GPU's instead
(`rematlab.core.card`): another process on the card, clocks slowed by heat or the hardware,
the launch thread's wait for a CPU, with the calibration kernel sized for a GPU; the host's
other cores do not slow a step that runs on the card. Each row names the rule that judged it
and, when untrusted, why (`Evidence.rule`, `Evidence.reason`).

Each repeat carries its own load and calibration, so the guard judges repeats, not whole
measurements: a disturbed repeat is measured again once the host is quiet, and a set whose
spread is too wide has its outlier measured again, within a budget of `retries`
re-measurements per repeat. Waiting is watching: the guard polls the host until a short
window is quiet (`wait_quiet`), for at most a back-off that doubles, so a passing hiccup
costs a fraction of a second and a busy spell no more than the back-off. A configuration
still untrusted at the end of a sweep is measured once more after a longer wait for quiet
(`settle_s`, see `rematlab.study.sweep`). It hands back the evidence — repeats run, drift,
spread, load, trusted — that the dataset stores with every row. Analyses use trusted
rows only and say how many they left out (`rematlab.study.store.trusted_only`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rematlab.core.card import CardLoad, CardReadings
from rematlab.core.clocks import Clock
from rematlab.core.spread import relative_spread

CALIBRATION_SIZE = 256  # square fp32 matrices: ~34 MFLOP per product, no allocation
# on a GPU 256 is a microsecond's kernel, whose launch jitter alone exceeds `DRIFT`: 2 GFLOP
# products there (~0.5 ms for the 16 on an H200's fp32 units)
CUDA_CALIBRATION_SIZE = 1024
CALIBRATION_PRODUCTS = 16
CALIBRATION_FLOPS = CALIBRATION_PRODUCTS * 2 * CALIBRATION_SIZE ** 3  # the kernel's work
DRIFT = 0.5  # calibration slower than the reference by more than this: disturbed
LOAD = 0.15  # other processes took more than this share of our CPUs' time: disturbed
NOISY = 0.10  # step-time IQR / median above this: too noisy to conclude from
RETRIES = 2
BACKOFF_S = 1.0
MAX_WAIT_S = 30.0  # seconds one configuration may spend waiting for a quiet host
POLL_S = 0.25  # the window in which the host must be quiet before a repeat is run again


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
        size = CUDA_CALIBRATION_SIZE if device.type == "cuda" else CALIBRATION_SIZE
        self.a = torch.rand(size, size, generator=gen).to(device)
        self.out = torch.empty_like(self.a)
        self.clock = clock

    def run(self) -> float:
        self.clock.start()
        for _ in range(CALIBRATION_PRODUCTS):
            torch.mm(self.a, self.a, out=self.out)
        return self.clock.stop()


@dataclass
class Sample:
    """One timed repeat: per phase, the mean seconds of its steps; how many steps; the
    calibration timed just before it; its steps' seconds summed; the foreign load while it
    ran (`None` where it cannot be read)."""

    times: dict[str, float]
    steps: int
    calibration: float
    measured_s: float
    load: float | None = None
    reason: str | None = None  # what the load reading saw (`card.CardLoad.reason`)

    def drift(self, reference: float) -> float:
        """How much slower than `reference` the calibration before this repeat ran."""
        return self.calibration / reference - 1.0 if reference > 0 else 0.0


def _steps(samples: list[Sample]) -> list[str]:
    """The entries the guard judges: each timed candidate's whole step (`rematlab.core.timer`
    names them `step` or `<candidate>/step`)."""
    return [k for k in samples[0].times if k == "step" or k.endswith("/step")] if samples else []


def spread(samples: list[Sample]) -> float:
    """The widest IQR over median among the samples' step times (0 for fewer than two)."""
    return max((relative_spread([s.times[k] for s in samples]) for k in _steps(samples)),
               default=0.0)


def _deviation(sample: Sample, kept: list[Sample]) -> float:
    """How far `sample` lies from the set's medians, the worst of its step times."""
    return max(abs(math.log(sample.times[k] / float(np.median([s.times[k] for s in kept]))))
               for k in _steps(kept))


@dataclass(frozen=True)
class Evidence:
    """What the guard saw: stored with every row of the configuration. `attempts` counts
    the timed repeats run, re-measured ones included."""

    attempts: int
    drift: float
    spread: float
    load: float | None
    trusted: bool
    reference_s: float
    waited_s: float = 0.0
    rule: str = "cpu"  # which rule judged the repeats (`RULES`)
    reason: str | None = None  # why untrusted

    def columns(self) -> dict[str, float | int | bool | str | None]:
        return {"attempts": self.attempts, "calibration_drift": self.drift,
                "step_spread": self.spread, "foreign_load": self.load,
                "trusted": self.trusted, "calibration_reference_s": self.reference_s,
                "waited_s": self.waited_s, "method_guard": RULES[self.rule],
                "guard_reason": self.reason}


RULES = {"cpu": "cpu: other processes' share of this process's CPUs (/proc), calibration "
                "drift, step-time spread",
         "gpu": "gpu: other processes or memory on the card (NVML, mem_get_info), thermal or "
                "hardware clock slowdowns (NVML), the launch thread's run-queue wait, "
                "calibration drift, step-time spread"}


@dataclass
class Guard:
    """The policy: thresholds, the number of re-measurements (`retries` per repeat, at
    most) and their back-off, the most seconds one configuration may wait for a quiet host
    (`max_wait_s`: once spent, disturbed repeats are kept and the configuration is flagged
    untrusted, so a machine that never gets quiet costs a bounded time), and the quiet
    reference known so far (`None`: the fastest calibration this process has seen).
    `waited_s` counts the seconds waited so far."""

    drift: float = DRIFT
    noisy: float = NOISY
    load: float = LOAD
    retries: int = RETRIES
    backoff_s: float = BACKOFF_S
    reference: float | None = None
    settle_s: float = 0.0  # wait up to this long for a quiet host before the first repeat
    max_wait_s: float = MAX_WAIT_S
    waited_s: float = 0.0
    sleep: Callable[[float], None] = time.sleep
    host: Callable[[], HostLoad] = HostLoad
    card: Callable[[torch.device], CardReadings] = CardReadings  # a GPU's readings

    def reader(self, device: torch.device | None) -> tuple[str, Callable[[], Any]]:
        """The rule that judges repeats on `device` and what reads its load: the card's
        (`card.CardLoad`) for a CUDA device, unless the host reader was replaced; else the
        host's."""
        if device is not None and device.type == "cuda" and self.host is HostLoad:
            readings = self.card(device)
            return "gpu", lambda: CardLoad(readings, self.load)
        return "cpu", self.host

    def describe(self) -> str:
        return (f"a repeat is disturbed when other processes took > {self.load:.0%} of this "
                f"process's CPUs while it ran (/proc/stat), or the calibration before it "
                f"({CALIBRATION_PRODUCTS} products of {CALIBRATION_SIZE}x{CALIBRATION_SIZE} "
                f"fp32 matrices) ran > {self.drift:.0%} slower than the fastest seen on this "
                f"device and thread count; a disturbed repeat, or the outlier of a set whose "
                f"IQR exceeds {self.noisy:.0%} of the median, is measured again once a "
                f"{POLL_S:g} s window of the host is quiet (waiting at most {self.backoff_s:g} "
                f"s, doubling to {4 * self.backoff_s:g} s), at most {self.retries} times per "
                f"repeat and {self.max_wait_s:g} s of waiting per configuration")

    def wait_quiet(self, limit_s: float, reader: Callable[[], Any] | None = None) -> bool:
        """Watch the host in `POLL_S` windows until one shows other processes below the
        load threshold, for at most `limit_s` (and what is left of `max_wait_s`): whether it
        became quiet. Without `/proc` there is nothing to watch, and the guard simply
        waits."""
        limit_s = min(limit_s, self.max_wait_s - self.waited_s)
        for _ in range(math.ceil(limit_s / POLL_S) if limit_s > 0 else 0):
            host = (reader or self.host)()
            host.start()
            self._wait(POLL_S)
            load = host.stop()
            if load is None:
                self._wait(max(0.0, limit_s - POLL_S))
                return False
            if load <= self.load:
                return True
        return False

    def _wait(self, seconds: float) -> None:
        self.sleep(seconds)
        self.waited_s += seconds

    def disturbed(self, sample: Sample, reference: float) -> bool:
        return sample.drift(reference) > self.drift or (
            sample.load is not None and sample.load > self.load)

    def run(self, repeat: Callable[[], Sample], repeats: int, key: tuple,
            device: torch.device | None = None
            ) -> tuple[list[Sample], list[Sample], Evidence]:
        """Collect `repeats` undisturbed samples of `repeat`, re-measuring a disturbed one
        (after waiting) or the outlier of a too-wide set, within the re-measure budget
        (`retries` x `repeats`). Returns the samples kept, every sample measured, and the
        evidence. `key` names the calibration's conditions (device, threads): references
        are only compared within one; `device` picks the rule (`reader`)."""
        rule, reader = self.reader(device)
        budget = self.retries * repeats
        kept: list[Sample] = []
        measured: list[Sample] = []
        redone = 0
        if self.settle_s > 0:
            self.wait_quiet(self.settle_s, reader)
        while True:
            while len(kept) < repeats:
                host = reader()
                host.start()
                sample = repeat()
                sample.load = host.stop()
                sample.reason = getattr(host, "reason", None)
                measured.append(sample)
                reference = self._reference(key, sample.calibration)
                if (self.disturbed(sample, reference) and redone < budget
                        and self.waited_s < self.max_wait_s):
                    redone += 1
                    self.wait_quiet(self.backoff_s * 2 ** min(redone - 1, 2), reader)
                    continue
                kept.append(sample)
            if spread(kept) <= self.noisy or redone >= budget:
                break
            kept.remove(max(kept, key=lambda s: _deviation(s, kept)))
            redone += 1
        reference = self._reference(key, math.inf)
        loads = [s.load for s in kept if s.load is not None]
        reason = self._why(kept, reference)
        return kept, measured, Evidence(
            attempts=len(measured), spread=spread(kept),
            drift=float(np.median([s.drift(reference) for s in kept])),
            load=max(loads) if loads else None, trusted=reason is None,
            reference_s=reference, waited_s=self.waited_s, rule=rule, reason=reason)

    def _why(self, kept: list[Sample], reference: float) -> str | None:
        """Why the kept repeats are not trusted (None: they are): the first disturbed
        repeat's reading, or its calibration's drift, or the set's spread."""
        for s in kept:
            if s.load is not None and s.load > self.load:
                return s.reason or f"other processes took {s.load:.0%} of this process's CPUs"
            if s.drift(reference) > self.drift:
                return (f"the calibration ran {s.drift(reference):.0%} slower than the "
                        "fastest seen")
        if spread(kept) > self.noisy:
            return f"step times spread {spread(kept):.0%} (IQR / median)"
        return None

    def _reference(self, key: tuple, calibration: float) -> float:
        seen = min(calibration, _FASTEST.get(key, math.inf),
                   self.reference if self.reference else math.inf)
        _FASTEST[key] = seen
        return seen


# the fastest calibration this process has timed, per (device, threads): a warm sweep worker
# carries it from one configuration to the next
_FASTEST: dict[tuple, float] = {}
