"""One timer for every step time rematlab reports: sweeps, the planner's profiles, the largest
batch, gradient runs and the benchmarks all time through `Timer.run`, so that a busy machine
is detected (and said) everywhere, not only in sweeps.

A run times one piece of work, or several side by side. Work is a function of the clock that
returns the seconds of its phases, `step` among them (`timed` makes one from a plain
callable). After `warmup` untimed calls of each, every repeat is a round: the guard's
calibration kernel, then each candidate for as many calls as last `min_repeat_s` (their mean
is the repeat, as `timeit` groups fast statements, so that clock resolution and scheduler
jitter do not dominate it). Interleaving candidates within a round makes a neighbour slow them
alike, so their ratio stays fair. The rounds run under `rematlab.core.guard.Guard`: a
disturbed round is timed again after waiting for quiet, within the guard's bounds, and the
result carries the guard's evidence (load, drift, spread, trusted).
"""

from __future__ import annotations

import contextlib
import statistics
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rematlab.core.clocks import Clock, clock_for
from rematlab.core.guard import LOAD, Calibration, Evidence, Guard, HostLoad, Sample
from rematlab.core.spread import iqr
from rematlab.core.steps import Phases, block_step

MIN_REPEAT_SECONDS = 0.2  # a repeat averages enough calls to last at least this long
MAX_CALLS_PER_REPEAT = 1000
Work = Callable[[Clock], dict[str, float]]  # one call: seconds per phase, "step" among them


def timed(fn: Callable[[], object]) -> Work:
    """A plain callable as work: the clock around the whole call is its `step`."""
    def work(clock: Clock) -> dict[str, float]:
        clock.start()
        fn()
        return {"step": clock.stop()}
    return work


def profile_guard() -> Guard:
    """The guard of the planner's profiles: it never waits or re-measures, since a profile
    times many blocks and a plan is verified by measured peaks, not by these times. A
    profile on a busy machine is said (`watched`)."""
    return Guard(retries=0, max_wait_s=0.0)


def profile_timer(device: torch.device) -> Timer:
    """The timer of the planner's profiles: one call per repeat, no calibration kernel, and a
    guard that judges without waiting or re-measuring (`profile_guard`)."""
    return Timer(device, guard=profile_guard(), min_repeat_s=0.0, calibrate=False)


@contextlib.contextmanager
def watched(what: str) -> Iterator[None]:
    """Warn when other processes took more than the guard's share (`LOAD`) of this process's
    CPUs while the block ran. A profile times many short calls, each too short for the
    kernel's jiffies to measure load, so it is watched whole: one reading over seconds."""
    host = HostLoad()
    host.start()
    yield
    load = host.stop()
    if load is not None and load > LOAD:
        warnings.warn(f"{what} were timed on a busy machine (foreign load {load:.0%}): the "
                      "plan's predicted times may be off; its peak is measured and "
                      "unaffected", RuntimeWarning, stacklevel=3)


def key(name: str, phase: str) -> str:
    """A sample's entry for `phase` of candidate `name` ('' for a single piece of work)."""
    return f"{name}/{phase}" if name else phase


class Turns:
    """What each candidate needs while it is timed (its batch, a model readied for it): made
    when the candidate's turn comes, shared by the calls of that turn, and dropped before
    another candidate's is made, so no two are alive at once."""

    def __init__(self, make: dict[str, Callable[[], Any]]) -> None:
        self.make = make
        self._name: str | None = None
        self._value: Any = None

    def __call__(self, name: str) -> Any:
        if name != self._name:
            self._name, self._value = None, None  # the previous turn's is freed first
            self._value = self.make[name]()
            self._name = name
        return self._value


@dataclass
class Timing:
    """The kept repeats, every repeat timed (kept or redone) and the guard's evidence."""

    kept: list[Sample]
    measured: list[Sample]
    evidence: Evidence

    def seconds(self, name: str = "", phase: str = "step") -> list[float]:
        return [s.times[key(name, phase)] for s in self.kept]

    def median(self, name: str = "", phase: str = "step") -> float:
        return statistics.median(self.seconds(name, phase))

    def iqr(self, name: str = "", phase: str = "step") -> float:
        return iqr(self.seconds(name, phase))

    @property
    def measured_s(self) -> float:
        """Seconds spent inside timed calls, redone repeats included."""
        return sum(s.measured_s for s in self.measured)


class Timer:
    """Times work on `device` with its clock (CUDA events on a GPU) under `guard`."""

    def __init__(self, device: torch.device, clock: Clock | None = None,
                 guard: Guard | None = None, min_repeat_s: float = MIN_REPEAT_SECONDS,
                 calibrate: bool = True) -> None:
        self.device = device
        self.clock = clock or clock_for(device)
        self.guard = guard or Guard()
        self.min_repeat_s = min_repeat_s
        self.calibrate = calibrate  # off: judged by foreign load alone (no drift, no kernel)
        self._calibration: Calibration | None = None

    def run(self, work: Work | dict[str, Work], repeats: int, warmup: int = 1) -> Timing:
        candidates = work if isinstance(work, dict) else {"": work}
        for one in candidates.values():
            for _ in range(warmup):
                one(self.clock)
        if self._calibration is None and self.calibrate:
            self._calibration = Calibration(self.device, self.clock)
        # uncalibrated rounds keep a reference of their own (zero: no drift), never the
        # calibrated one other timings are judged against
        conditions = (str(self.device), torch.get_num_threads(),
                      *(() if self.calibrate else ("uncalibrated",)))
        kept, measured, evidence = self.guard.run(lambda: self._round(candidates), repeats,
                                                  key=conditions, device=self.device)
        return Timing(kept, measured, evidence)

    def _round(self, candidates: dict[str, Work]) -> Sample:
        calibrated = self._calibration.run() if self._calibration is not None else 0.0
        times: dict[str, float] = {}
        calls = 0
        elapsed = 0.0
        for name, one in candidates.items():
            runs: list[dict[str, float]] = []
            spent = 0.0
            while not runs or (spent < self.min_repeat_s and len(runs) < MAX_CALLS_PER_REPEAT):
                runs.append(one(self.clock))
                spent += runs[-1]["step"]
            times.update({key(name, phase): statistics.fmean(r[phase] for r in runs)
                          for phase in runs[0]})
            calls += len(runs)
            elapsed += spent
        return Sample(times=times, steps=calls, calibration=calibrated, measured_s=elapsed)


class _Timed(Phases):
    """A block's forward and backward seconds by `clock` (`steps.block_step`'s phases)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.seconds = {"forward": 0.0, "backward": 0.0}

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        self.clock.start()
        yield
        self.seconds[name] = self.clock.stop()

    def forward(self) -> contextlib.AbstractContextManager:
        return self._phase("forward")

    def backward(self) -> contextlib.AbstractContextManager:
        return self._phase("backward")


def time_block(block: Callable[[torch.Tensor], torch.Tensor], x_in: torch.Tensor,
               repeats: int) -> tuple[float, float]:
    """Median forward and backward seconds of `block` on `x_in`, by the one timer
    (`rematlab.core.timer`, short repeats: a profile's figure, not a sweep's). No warm-up of
    its own: its callers have just run the block on the same input (a tracked run)."""
    def work(clock: Clock) -> dict[str, float]:
        timed = _Timed(clock)
        block_step(block, x_in, timed)
        return {**timed.seconds, "step": sum(timed.seconds.values())}

    timer = profile_timer(x_in.device)
    timing = timer.run(work, repeats, warmup=0)
    return timing.median(phase="forward"), timing.median(phase="backward")
