"""Measure one training configuration: a frozen `Spec` in, an `Observation` out.

A step is forward, cross-entropy loss, backward (which includes recomputation) and an
optimizer step, on synthetic data. The protocol, in order:

1. The optimizer's state is made as its first step makes it, by a step that changes nothing:
   zero gradients at learning rate 0 (`_optimizer_state`).
2. One *tracked* step, the first real one: the peak memory of the whole step with the
   optimizer state present (CUDA: allocator peak after a reset, its BLAS workspaces
   allocated inside it; CPU: the larger of the live-tensor tracker and the allocator's events
   — see `rematlab.core.probes`), per phase. Byte counts do not vary between identical steps,
   so one tracked step is all the figure needs. With a `max_memory` cap it is capped, so an
   OOM stops the run before anything is timed.
3. FLOPs (forward, backward, of which recomputation) and the bytes saved for backward are
   counted once per shape: configurations that differ only in optimizer or run settings reuse
   the count (`FlopCounterMode` counts no optimizer update). They are counted the cheaper way
   (`_counted`): on the configuration's fake twin (`rematlab.preflight.fake`: every op's
   shapes, dtypes and storages, no data, no kernel) where the tracked step took 0.1 s or
   more, else on a real step (a GPU's steps, small models), and on a real step where fake
   tensors cannot run the model (data-dependent code).
4. `warmup - 1` more untimed steps (the tracked step is the warm-up's first).
5. `repeats` *timed* repeats under `rematlab.core.guard`: a calibration kernel, then as many steps
   as last `MIN_REPEAT_SECONDS` (their mean is the repeat), device-synchronised clock around
   each phase (CUDA events on GPU), nothing else on. A disturbed repeat is measured again, a
   bounded number of times; the evidence goes into every row.

Counting never happens in the tracked step: counting recomputation keeps recomputed tensors
alive longer (a tracked step that also counted peaked 4-50 % higher under remat, see
docs/design.md) and the CPU tracker's per-op bookkeeping would inflate the times. Counting on
fakes where a step is slow is what keeps the protocol's untimed work to about one step a
configuration (issue 51: it was two real steps, 34-48 % of a CPU configuration's time).
Out-of-memory — real, or past the `max_memory` cap that emulates a smaller device — is an
outcome, `oom`, not a crash.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from collections.abc import Callable

import torch
from torch import nn

from rematlab.core import flops as flop_count
from rematlab.core.batch import DTYPES, Batch, cast, make_example, tensors
from rematlab.core.clocks import Clock, WallClock, clock_for
from rematlab.core.guard import MAX_WAIT_S, Guard
from rematlab.core.optimizers import make_optimizer
from rematlab.core.probes import (
    MemoryProbe,
    PhaseMarker,
    StepMemory,
    peak_of,
    storage_key,
)
from rematlab.core.recipe import Step
from rematlab.core.steps import is_oom, runs_on
from rematlab.core.timer import MIN_REPEAT_SECONDS, Timer
from rematlab.exceptions import ConfigError, SimulatedOOM
from rematlab.measurement import zoo
from rematlab.measurement.spec import Observation, Spec, available, environment, parse_device
from rematlab.preflight.fake import FakeSession
from rematlab.remat import strategies
from rematlab.remat.layers import remat_of


class _Setup:
    """Model, optimizer and synthetic batch of one configuration; `remat` is the runner of
    the plan (its blocks, plan and recompute stats), `run` the model to call. `build` makes
    it on its device, `fake` its fake twin."""

    def __init__(self, spec: Spec, model: nn.Module, batch: Batch, clock: Clock) -> None:
        self.spec, self.model, self.batch = spec, model, batch
        self.run = strategies.apply(self.model, spec.strategy, blocks=spec.blocks,
                                    example_input=self.batch)
        self.remat = self.run if isinstance(self.run, strategies.RematChain) else \
            remat_of(self.run)
        # its own instance of the step's kind of clock: recomputation is timed inside backward,
        # which the step's clock is timing at the same moment
        self.remat.recompute.clock = copy.copy(clock)
        self.opt = make_optimizer(spec.optimizer, self.model.parameters())
        self.step = Step(precision=spec.precision, optimizer=spec.optimizer)

    @classmethod
    def build(cls, spec: Spec, device: torch.device, clock: Clock) -> _Setup:
        dtype = DTYPES[spec.dtype]
        torch.manual_seed(spec.seed)
        model, shape, _ = zoo.resolve(spec.model, spec.input, spec.input_shape)
        batch = cast(make_example(spec.batch, shape, input_dtype=spec.input_dtype or "float32",
                                  vocab=spec.vocab, example=spec.example, device=device,
                                  seed=spec.seed), dtype)
        return cls(spec, model.to(device=device, dtype=dtype).train(), batch, clock)

    def fake(self, session: FakeSession) -> _Setup:
        """The same configuration on fake twins of its model and batch (run it inside
        `session.active()`), timed by the wall clock: no kernel runs to synchronise."""
        return _Setup(self.spec, session.model(self.model), session.batch(self.batch),
                      WallClock())

    def persistent(self) -> list[torch.Tensor]:
        state = [t for s in self.opt.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor)]
        return [*self.model.parameters(), *self.model.buffers(), *state, *tensors(self.batch)]


def _step(s: _Setup, clock: Clock, around: PhaseMarker | None = None) -> dict[str, float]:
    """One training step as the configuration's `Step` runs it (`Step.train_step`: autocast
    and a GradScaler where its precision says so) with its recomputation's seconds, which
    the plan's runner times inside backward."""
    s.remat.recompute.seconds = 0.0
    times = s.step.train_step(s.model, s.batch, run=s.run, optimizer=s.opt, clock=clock,
                              around=around)
    times["recompute"] = s.remat.recompute.seconds
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
        self.seconds = 0.0

    def run(self, clock: Clock) -> tuple[int, int]:
        """Peak and reserved bytes of one step; `seconds` its wall time (it measures the
        peak, so the sweep counts it as measuring, not as harness)."""
        self.s.opt.zero_grad(set_to_none=True)  # the step starts without last step's grads
        t0 = time.perf_counter()
        peak_of(self.memory, self.s.persistent(), lambda phase: _step(self.s, clock, phase))
        self.seconds = time.perf_counter() - t0
        self.phase_peaks = dict(self.memory.phase_peaks)
        peak = self.memory.peak
        if self.cap is not None and peak > self.cap:
            raise SimulatedOOM(f"peak {peak} exceeds the cap {self.cap}")
        return peak, self.memory.reserved


# What counting on the fake twin costs the host: 0.03-0.2 s for the study's models (its
# Python dispatch, whatever the device). A step faster than this is counted for real.
FAKE_COUNT_S = 0.1


def _counted(s: _Setup, step_s: float, clock: Clock) -> dict[str, float]:
    """The configuration's FLOPs and saved bytes (module docstring, step 3), counted the
    cheaper way: on a real step (timed by `clock`, the step's) where one took `step_s` <
    `FAKE_COUNT_S` (a GPU's millisecond steps, small models), else on the fake twin; and on
    a real step where fakes cannot run the model. A real counted step runs after the tracked
    one, never in it."""
    if step_s >= FAKE_COUNT_S:
        session = FakeSession(cuda=parse_device(s.spec.device).type == "cuda")
        try:
            with session.active():
                return _Counted(s.fake(session)).run(WallClock())
        except Exception:  # data-dependent code (`.item()`, `nonzero`): fakes have no values
            pass
    return _Counted(s).run(clock)


def _optimizer_state(s: _Setup) -> None:
    """Make the optimizer's state as a first step would (module docstring, step 1): one
    update from zero gradients at learning rate 0, which moves no parameter (momentum, Adam's
    moments, AdamW's decay and `MixedAdamW`'s master copy all scale by the rate), so the
    tracked step is the first real one and finds the state present, as every later step."""
    params = [p for group in s.opt.param_groups for p in group["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    rates = [group["lr"] for group in s.opt.param_groups]
    try:
        for group in s.opt.param_groups:
            group["lr"] = 0.0
        s.opt.step()
    finally:
        for group, rate in zip(s.opt.param_groups, rates, strict=True):
            group["lr"] = rate
        s.opt.zero_grad(set_to_none=True)


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
        counter = flop_count.counter()
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


# counted figures per shape (`count_key`), kept for the life of the process: a warm sweep
# worker counts each shape once
_COUNTED: dict[tuple, dict[str, float]] = {}


def count_key(spec: Spec) -> tuple:
    """What FLOPs and saved bytes depend on: not the optimizer (no update is a counted op),
    the repeats, the threads or a memory cap."""
    return (spec.model, spec.input, spec.input_shape, spec.batch, spec.strategy, spec.device,
            spec.dtype, spec.seed, spec.example, spec.input_dtype, spec.vocab, spec.blocks)


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
    least = MIN_REPEAT_SECONDS if spec.min_repeat_s is None else spec.min_repeat_s
    obs.methods = {
        "time": f"{type(clock).__name__}, device-synchronised, per phase; median and IQR "
                f"of {spec.repeats} repeats after {spec.warmup} warm-up steps, each repeat the "
                f"mean of the steps that last {least:g} s (steps_per_repeat)",
        "peak": f"{memory(device, None).method}, one tracked step, the first (the "
                "optimizer's state made before it by a zero-gradient update at rate 0)",
        "flops": "torch.utils.flop_counter.FlopCounterMode, once per shape, after the "
                 f"tracked step: on the step's fake twin where that took {FAKE_COUNT_S:g} s "
                 "or more, else (or where fakes cannot run the model) on a real step",
        "saved": "saved_tensors_hooks + checkpoint inputs, storage-deduplicated, parameters, "
                 "buffers and the input batch excluded",
        "guard": guard.describe(),
    }
    setup = None
    try:
        setup = _Setup.build(spec, device, clock)
        if not _zoo_input(spec):  # a zoo model's own input always fits it
            runs_on(setup.model, setup.run, setup.batch, spec.model)
        _optimizer_state(setup)
        tracked = _Tracked(setup, memory(device, spec.max_memory), spec.max_memory)
        peak, reserved = tracked.run(clock)
        key = count_key(spec)
        if key not in _COUNTED:
            _COUNTED[key] = _counted(setup, tracked.seconds, clock)
        counted = _COUNTED[key]
        timing = Timer(device, clock, guard, min_repeat_s=least).run(
            functools.partial(_step, setup), spec.repeats, warmup=spec.warmup - 1)
        kept, obs.evidence = timing.kept, timing.evidence
        obs.times = {phase: [k.times[phase] for k in kept] for phase in kept[0].times}
        obs.steps, obs.calibration = [k.steps for k in kept], [k.calibration for k in kept]
        obs.peaks, obs.reserved, obs.phase_peaks = [peak], [reserved], tracked.phase_peaks
        obs.measured_seconds = timing.measured_s + tracked.seconds
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
