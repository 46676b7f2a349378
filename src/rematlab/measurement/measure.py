"""Measure one training configuration: a frozen `Spec` in, an `Observation` out.

A step is forward, cross-entropy loss, backward (which includes recomputation) and an
optimizer step, on synthetic data. The steps, in order:

1. the first step counts FLOPs (forward, backward, of which recomputation) and the bytes
   saved for backward — once per shape: configurations that differ only in optimizer or
   run settings reuse the count (`FlopCounterMode` counts no optimizer update: elementwise);
   with a `max_memory` cap a tracked, capped step goes first, so an OOM stops the run early;
2. one *tracked* step: the peak memory of the whole step with the optimizer state present
   (CUDA: allocator peak after a reset; CPU: the larger of the live-tensor tracker and the
   allocator's events — see `rematlab.core.probes`), per phase. Byte counts do not vary between
   identical steps, so one tracked step is all the figure needs;
3. `warmup - 2` more untimed steps;
4. `repeats` *timed* repeats under `rematlab.core.guard`: a calibration kernel, then as many steps
   as last `MIN_REPEAT_SECONDS` (their mean is the repeat), device-synchronised clock around
   each phase (CUDA events on GPU), nothing else on. A disturbed repeat is measured again, a
   bounded number of times; the evidence goes into every row.

Counting and tracking happen in steps of their own: counting recomputation keeps recomputed
tensors alive longer (a tracked step that also counted peaked 4-50 % higher under remat, see
docs/design.md) and the CPU tracker's per-op bookkeeping would inflate the times. The two
untimed steps are the warm-up's first two.
Out-of-memory — real, or past the `max_memory` cap that emulates a smaller device — is an
outcome, `oom`, not a crash.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import platform
import socket
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from rematlab.core.guard import MAX_WAIT_S, NOISY, Calibration, Evidence, Guard, Sample
from rematlab.core.probes import Clock, MemoryProbe, StepMemory, clock_for, storage_key
from rematlab.core.steps import (
    INPUT_DTYPES,
    MAX_BATCH_SIZE,
    MAX_VOCAB,
    OPTIMIZERS,
    bounded,
    call,
    cast,
    default_loss,
    is_oom,
    make_example,
    make_optimizer,
    runs_on,
    tensors,
)
from rematlab.exceptions import ConfigError, SimulatedOOM
from rematlab.measurement import zoo
from rematlab.remat import strategies
from rematlab.remat.layers import remat_of
from rematlab.version import __version__

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
# what the results store's columns hold (INTEGER, BIGINT), and sane bounds on run settings
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_REPEATS = 10_000
MAX_THREADS = 4096
MIN_REPEAT_SECONDS = 0.2  # a repeat averages enough steps to last at least this long
MAX_STEPS_PER_REPEAT = 1000


def steps_per_repeat(step_seconds: float) -> int:
    """Fast steps are averaged in groups (as `timeit` does) so that clock resolution and
    scheduler jitter do not dominate a repeat; slow steps are timed one by one."""
    if step_seconds <= 0:
        return 1
    return max(1, min(MAX_STEPS_PER_REPEAT, math.ceil(MIN_REPEAT_SECONDS / step_seconds)))


@dataclass(frozen=True)
class Spec:
    """What is measured. Frozen, hashable, and the identity of a configuration in a sweep."""

    model: str
    batch: int
    strategy: str = "none"
    input: str | None = None
    input_shape: tuple[int, ...] | None = None
    device: str = "cpu"
    dtype: str = "float32"
    optimizer: str = "momentum"
    warmup: int = 2
    repeats: int = 5
    max_memory: int | None = None
    threads: int | None = None
    seed: int = 0
    # a user's model beyond the zoo: its batches, and the layers its own loop runs
    example: str | None = None  # module:fn, fn(batch) -> tensor, tuple or dict
    input_dtype: str | None = None  # e.g. int64: token ids below `vocab`
    vocab: int | None = None
    blocks: str | None = None  # e.g. transformer.h

    def validate(self) -> Spec:
        """Check every field; return the spec with the zoo's default input filled in."""
        bounded("batch", self.batch, MAX_BATCH_SIZE)
        bounded("warmup (2 make the optimizer state)", self.warmup, MAX_REPEATS, low=2)
        bounded("repeats", self.repeats, MAX_REPEATS)
        if self.threads is not None:
            bounded("threads", self.threads, MAX_THREADS)
        bounded("seed", self.seed, INT32_MAX, low=0)
        if self.vocab is not None:
            bounded("vocab", self.vocab, MAX_VOCAB)
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose one of {sorted(DTYPES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}; choose one of {OPTIMIZERS}")
        if self.max_memory is not None and not 0 < self.max_memory <= INT64_MAX:
            raise ConfigError(f"max_memory must be positive (bytes), got {self.max_memory}")
        strat = strategies.parse(self.strategy)
        if strat.kind == "plan":
            strat.load()  # a missing or malformed plan file is bad input, not a failed run
        parse_device(self.device)
        if self.model in zoo.REGISTRY:
            return replace(self, input=zoo.scale_of(self.model, self.input))
        if ":" not in self.model:
            raise ConfigError(f"unknown model {self.model!r}; choose one of "
                              f"{sorted(zoo.REGISTRY)} or give module.path:factory")
        if self.input_shape is None and self.example is None:
            raise ConfigError(f"model {self.model!r} needs an input shape (--input-shape) or "
                              "a batch factory (--example module:fn)")
        if self.input_dtype is not None and self.input_dtype not in INPUT_DTYPES:
            raise ConfigError(f"unknown input dtype {self.input_dtype!r}; choose one of "
                              f"{sorted(INPUT_DTYPES)}")
        if self.vocab is not None and self.vocab <= 0:
            raise ConfigError(f"vocab must be positive, got {self.vocab}")
        return self

    def to_dict(self) -> dict:
        """Every field; the user-model fields only when set, so that the identity (hash) of
        a zoo configuration stays what it was before they existed."""
        d = asdict(self)
        d["input_shape"] = list(self.input_shape) if self.input_shape else None
        for key in _USER_FIELDS:
            if d[key] is None:
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Spec:
        d = dict(d)
        if d.get("input_shape"):
            d["input_shape"] = tuple(d["input_shape"])
        return cls(**d)


_USER_FIELDS = ("example", "input_dtype", "vocab", "blocks")


@dataclass
class Observation:
    """What was observed: raw per-repeat figures plus the step's static figures."""

    spec: Spec
    outcome: str  # ok | oom | error
    error: str | None = None
    times: dict[str, list[float]] = field(default_factory=dict)  # phase -> seconds per repeat
    peaks: list[int] = field(default_factory=list)  # bytes per tracked step
    reserved: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # steps each timed repeat averaged
    calibration: list[float] = field(default_factory=list)  # seconds, before each repeat
    evidence: Evidence | None = None
    phase_peaks: dict[str, int] = field(default_factory=dict)
    figures: dict[str, float] = field(default_factory=dict)
    methods: dict[str, str] = field(default_factory=dict)
    env: dict[str, str | int | None] = field(default_factory=dict)
    measured_seconds: float = 0.0  # time spent inside measured steps

    def median(self, phase: str = "step") -> float:
        return statistics.median(self.times[phase]) if self.times.get(phase) else math.nan

    def iqr(self, phase: str = "step") -> float:
        values = self.times.get(phase) or []
        if len(values) < 2:
            return math.nan
        q1, q3 = np.percentile(values, [25, 75])
        return float(q3 - q1)

    @property
    def noisy(self) -> bool:
        """The step-time IQR exceeds `guard.NOISY` of its median."""
        med = self.median()
        return bool(med > 0 and self.iqr() / med > NOISY)

    @property
    def peak(self) -> int | None:
        return max(self.peaks) if self.peaks else None

    def summary(self) -> dict:
        """One flat dict: medians, IQRs, peak, figures, methods (what a CLI prints as JSON)."""
        out: dict = {"spec": self.spec.to_dict(), "outcome": self.outcome, "error": self.error}
        for phase in self.times:
            out[f"{phase}_s_median"] = self.median(phase)
            out[f"{phase}_s_iqr"] = self.iqr(phase)
        out["peak_bytes"] = self.peak
        out["phase_peak_bytes"] = self.phase_peaks
        out["noisy"] = self.noisy if self.times else None
        out["repeats"] = len(self.times.get("step", []))
        out.update(self.figures)
        if self.evidence:
            out.update(self.evidence.columns())
        out["methods"] = self.methods
        out["env"] = self.env
        return out

    def rows(self) -> list[dict]:
        """One dict per repeat (the dataset's grain); a failed run is one row with its outcome."""
        base = {**{f"cfg_{k}": v for k, v in self.spec.to_dict().items()},
                "outcome": self.outcome, "error": self.error, **self.figures,
                **{f"method_{k}": v for k, v in self.methods.items()}, **self.env,
                **(self.evidence.columns() if self.evidence else {})}
        base["cfg_input_shape"] = ",".join(map(str, self.spec.input_shape or ())) or None
        n = max(len(self.times.get("step", [])), 1)

        def at(values: list, r: int):
            return values[r] if r < len(values) else None

        rows = []
        for r in range(n):  # tracked figures sit on the rows of the repeats that had them
            row = dict(base, repeat=r, peak_bytes=at(self.peaks, r),
                       reserved_bytes=at(self.reserved, r), steps_per_repeat=at(self.steps, r),
                       calibration_s=at(self.calibration, r))
            for phase, values in self.times.items():
                row[f"{phase}_s"] = at(values, r)
            rows.append(row)
        return rows


def parse_device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ConfigError(f"unknown device {text!r}; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"unsupported device {text!r}; use cpu, cuda or cuda:N")
    return device


def available(device: torch.device) -> torch.device:
    """`device` when this machine has it; a `ConfigError` naming it otherwise."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {str(device)!r} requested but CUDA/ROCm is not "
                              "available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {str(device)!r} does not exist: this machine has "
                              f"{torch.cuda.device_count()} GPU(s)")
    return device


def environment(device: torch.device) -> dict[str, str | int | None]:
    """Where a figure was measured (stored with every row)."""
    cuda = device.type == "cuda"
    vendor = "CPU"
    if cuda:
        vendor = "AMD" if torch.version.hip else "NVIDIA"
    return {
        "device_name": torch.cuda.get_device_name(device) if cuda else _cpu_model(),
        "vendor": vendor,
        "cuda_version": torch.version.cuda if cuda and not torch.version.hip else None,
        "rocm_version": torch.version.hip if cuda else None,
        "torch_version": torch.__version__,
        "cpu_model": _cpu_model(),
        "threads": torch.get_num_threads(),
        "host": socket.gethostname(),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "rematlab_version": __version__,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class _Setup:
    """Model, optimizer and synthetic batch of one configuration, on its device; `remat` is
    the runner of the plan (its blocks, plan and recompute stats), `run` the model to call."""

    def __init__(self, spec: Spec, device: torch.device, clock: Clock) -> None:
        self.spec = spec
        dtype = DTYPES[spec.dtype]
        torch.manual_seed(spec.seed)
        model, shape, _ = zoo.resolve(spec.model, spec.input, spec.input_shape)
        self.model = model.to(device=device, dtype=dtype).train()
        self.batch = cast(make_example(spec.batch, shape, input_dtype=spec.input_dtype or
                                       "float32", vocab=spec.vocab, example=spec.example,
                                       device=device, seed=spec.seed), dtype)
        self.run = strategies.apply(self.model, spec.strategy, blocks=spec.blocks,
                                    example_input=self.batch)
        self.remat = self.run if isinstance(self.run, strategies.RematChain) else \
            remat_of(self.run)
        # its own instance of the step's kind of clock: recomputation is timed inside backward,
        # which the step's clock is timing at the same moment
        self.remat.recompute.clock = copy.copy(clock)
        self.opt = make_optimizer(spec.optimizer, self.model.parameters())

    def persistent(self) -> list[torch.Tensor]:
        state = [t for s in self.opt.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor)]
        return [*self.model.parameters(), *self.model.buffers(), *state, *tensors(self.batch)]


def _step(s: _Setup, clock: Clock, around: Callable[[str], object] | None = None
          ) -> dict[str, float]:
    """One training step; `around(phase)` may return a context manager wrapping the phase.
    The output stays alive until the step ends, as in a user's loop."""
    def ctx(phase: str):
        return around(phase) if around else contextlib.nullcontext()

    s.opt.zero_grad(set_to_none=True)
    s.remat.recompute.seconds = 0.0
    times = {}
    clock.start()
    with ctx("forward"):
        out = call(s.run, s.batch)
        loss = default_loss(out, s.batch)
    times["forward"] = clock.stop()
    clock.start()
    with ctx("backward"):
        loss.backward()
    times["backward"] = clock.stop()
    clock.start()
    with ctx("optimizer"):
        s.opt.step()
    times["optimizer"] = clock.stop()
    del out, loss
    times["recompute"] = s.remat.recompute.seconds
    times["step"] = times["forward"] + times["backward"] + times["optimizer"]
    return times


MemoryFactory = Callable[[torch.device, int | None], MemoryProbe]


def step_memory(device: torch.device, cap: int | None) -> MemoryProbe:
    """The default memory probe (`probes.StepMemory`)."""
    return StepMemory(device, cap)


class _Tracked:
    """One tracked step: peaks per phase from the memory probe."""

    def __init__(self, s: _Setup, memory: MemoryProbe, cap: int | None) -> None:
        self.s, self.memory, self.cap = s, memory, cap
        self.phase_peaks: dict[str, int] = {}

    def run(self, clock: Clock) -> tuple[int, int]:
        """Peak and reserved bytes of one step."""
        self.s.opt.zero_grad(set_to_none=True)
        self.memory.track(self.s.persistent())
        with self.memory:
            _step(self.s, clock, self.memory.phase)
        self.phase_peaks = dict(self.memory.phase_peaks)
        peak = self.memory.peak
        if self.cap is not None and peak > self.cap:
            raise SimulatedOOM(f"peak {peak} exceeds the cap {self.cap}")
        return peak, self.memory.reserved


class _Counted:
    """One counted step: FLOPs per phase (recomputation apart) and the bytes saved for
    backward."""

    def __init__(self, s: _Setup) -> None:
        self.s = s
        self.flops: dict[str, float] = {}
        self.saved_bytes = 0

    def run(self, clock: Clock) -> dict[str, float]:
        _step(self.s, clock, self._around)
        return {"saved_activation_bytes": self.saved_bytes,
                **{f"{phase}_flops": self.flops.get(phase, 0.0)
                   for phase in ("forward", "backward", "recompute", "optimizer")}}

    def _around(self, phase: str):
        stack = contextlib.ExitStack()
        counter = FlopCounterMode(display=False)
        stack.callback(lambda: self.flops.__setitem__(phase, counter.get_total_flops()))
        stack.enter_context(counter)
        if phase == "backward":
            stack.enter_context(self._count_recompute())
        if phase == "forward":
            stack.enter_context(self._saved_probe())
        return stack

    def _count_recompute(self):
        rec = self.s.remat.recompute

        @contextlib.contextmanager
        def counting():
            rec.count_flops, rec.flops = True, 0
            try:
                yield
            finally:
                rec.count_flops = False
                self.flops["recompute"] = rec.flops

        return counting()

    def _saved_probe(self):
        s = self.s
        excluded = {storage_key(t) for t in [*s.model.parameters(), *s.model.buffers(),
                                             *tensors(s.batch)]}
        seen: dict = {}

        def note(t: torch.Tensor) -> None:
            key = storage_key(t)
            if key not in excluded:
                seen[key] = t.untyped_storage().nbytes()

        def pack(t: torch.Tensor) -> torch.Tensor:
            note(t)
            return t

        @contextlib.contextmanager
        def probe():
            s.remat.hooks.append(note)
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    yield
            finally:
                s.remat.hooks.remove(note)
                self.saved_bytes = sum(seen.values())

        return probe()


# counted figures per shape (`_count_key`), kept for the life of the process: a warm sweep
# worker counts each shape once
_COUNTED: dict[tuple, dict[str, float]] = {}


def _count_key(spec: Spec) -> tuple:
    """What FLOPs and saved bytes depend on: not the optimizer (no update is a counted op),
    the repeats, the threads or a memory cap."""
    return (spec.model, spec.input, spec.input_shape, spec.batch, spec.strategy, spec.device,
            spec.dtype, spec.seed, spec.example, spec.input_dtype, spec.vocab, spec.blocks)


def _repeat(s: _Setup, clock: Clock, calibration: Calibration) -> Sample:
    """One timed repeat, after a calibration: the mean of as many steps as last
    `MIN_REPEAT_SECONDS` (as `timeit` groups fast statements), so that clock resolution and
    scheduler jitter do not dominate it."""
    calibrated = calibration.run()
    runs: list[dict[str, float]] = []
    elapsed = 0.0
    while elapsed < MIN_REPEAT_SECONDS and len(runs) < MAX_STEPS_PER_REPEAT:
        runs.append(_step(s, clock))
        elapsed += runs[-1]["step"]
    return Sample(times={phase: statistics.fmean(r[phase] for r in runs) for phase in runs[0]},
                  steps=len(runs), calibration=calibrated, measured_s=elapsed)


def measure(spec: Spec, clock: Clock | None = None, memory: MemoryFactory | None = None,
            guard: Guard | None = None) -> Observation:
    """Measure `spec` (see module docstring). Never raises for OOM or runtime failures:
    they become the observation's outcome. Bad specs raise `ConfigError`. `clock` times the
    phases (and, as a copy of it, recomputation and the calibration); `memory(device, cap)`
    makes the probe of a tracked step; `guard` decides when timings were disturbed: all are
    swappable, so tests drive this logic without hardware or a busy machine."""
    memory = memory or step_memory
    guard = guard or Guard()
    spec = spec.validate()
    device = available(parse_device(spec.device))
    if spec.threads:
        torch.set_num_threads(spec.threads)
    obs = Observation(spec=spec, outcome="ok", env=environment(device))
    clock = clock or clock_for(device)
    obs.methods = {
        "time": f"{type(clock).__name__}, device-synchronised, per phase; median and IQR "
                f"of {spec.repeats} repeats after {spec.warmup} warm-up steps, each repeat the "
                f"mean of the steps that last {MIN_REPEAT_SECONDS:g} s (steps_per_repeat)",
        "peak": f"{memory(device, None).method}, one tracked step after the first",
        "flops": "torch.utils.flop_counter.FlopCounterMode, first step, once per shape",
        "saved": "saved_tensors_hooks + checkpoint inputs, storage-deduplicated, parameters, "
                 "buffers and the input batch excluded",
        "guard": guard.describe(),
    }
    setup = None
    try:
        setup = _Setup(spec, device, clock)
        if not _zoo_input(spec):  # a zoo model's own input always fits it
            runs_on(setup.model, setup.run, setup.batch, spec.model)
        if spec.max_memory is not None:
            _Tracked(setup, memory(device, spec.max_memory), spec.max_memory).run(clock)
        counted = _COUNTED.get(_count_key(spec))
        if counted is None:
            counted = _COUNTED[_count_key(spec)] = _Counted(setup).run(clock)
        elif spec.max_memory is None:
            _step(setup, clock)  # the first step makes the optimizer state
        tracked = _Tracked(setup, memory(device, spec.max_memory), spec.max_memory)
        peak, reserved = tracked.run(clock)
        for _ in range(spec.warmup - 2):
            _step(setup, clock)
        calibration = Calibration(device, clock)
        kept, measured, obs.evidence = guard.run(
            functools.partial(_repeat, setup, clock, calibration), spec.repeats,
            key=(str(device), torch.get_num_threads()))
        obs.times = {phase: [k.times[phase] for k in kept] for phase in kept[0].times}
        obs.steps, obs.calibration = [k.steps for k in kept], [k.calibration for k in kept]
        obs.peaks, obs.reserved, obs.phase_peaks = [peak], [reserved], tracked.phase_peaks
        obs.measured_seconds = sum(m.measured_s for m in measured)
        obs.figures = {**_figures(setup), **counted}
    except ConfigError:
        raise
    except Exception as exc:  # an outcome to record, not a crash
        obs.outcome = "oom" if is_oom(exc) else "error"
        obs.error = f"{type(exc).__name__}: {exc}"[:500]
        obs.times, obs.peaks, obs.reserved, obs.evidence = {}, [], [], None
    finally:
        del setup
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return obs


def _zoo_input(spec: Spec) -> bool:
    """A zoo model on the batch the zoo makes for it: nothing a user gave can mismatch."""
    return spec.model in zoo.REGISTRY and spec.input_shape is None and spec.example is None


def _figures(s: _Setup) -> dict[str, float]:
    params = [p for p in s.model.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    state = [t for st in s.opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return {
        "params": sum(p.numel() for p in params),
        "param_bytes": param_bytes,
        "grad_bytes": sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        "optimizer_state_bytes": sum(t.numel() * t.element_size() for t in state if t.dim() > 0),
        "n_blocks": len(s.remat.blocks),
        "n_segments": len(s.remat.plan.segments),
        "plan": s.remat.plan.describe(),
    }


def run_config(spec_dict: dict, reference: float | None = None, settle_s: float = 0.0,
               max_wait_s: float = MAX_WAIT_S) -> dict:
    """Measure one configuration in whatever process calls this (a sweep's worker process, a
    Ray task) -> its rows and measured seconds; a bad spec is a recorded `error` row.
    `reference`: the quietest calibration the sweep has seen on this device (seconds);
    `settle_s`: how long to wait for a quiet host before timing (a second attempt);
    `max_wait_s`: the most this configuration may wait for quiet in all."""
    spec = Spec.from_dict(spec_dict)
    try:
        obs = measure(spec, guard=Guard(reference=reference, settle_s=settle_s,
                                        max_wait_s=max_wait_s))
    except ConfigError as exc:
        return {"rows": [failed_row(spec, "error", str(exc))], "measured_s": 0.0}
    return {"rows": obs.rows(), "measured_s": obs.measured_seconds}


def failed_row(spec: Spec, outcome: str, message: str) -> dict:
    """The one row a configuration that produced no measurement leaves in the dataset."""
    return Observation(spec=spec, outcome=outcome, error=message).rows()[0]
