"""The largest batch whose training step fits a memory budget, without remat and with the
optimal plan, and the throughput of each: "does remat pay off?" for the user's own model.

Rematerialization buys memory with time; what a user gains is a larger batch. Whether that
is worth it is a throughput question (samples per second at the largest batch each way), and
its answer depends on the model and the device, so it is measured, not assumed.

Searching by measurement alone would profile the model at a dozen large batches. Instead:

1. *Model.* For a fixed plan, a step's memory is affine in the batch size (activations grow
   with it; weights, gradients and optimizer state do not). The model's costs are profiled
   on the device at two small batches and every cost is interpolated to any batch
   (`scaled`). On that model an exponential then binary search finds the largest batch whose
   simulated peak (no remat) or smallest plan peak (the solver's floor) fits the budget. Each
   probe is a dynamic programme over the blocks: milliseconds.
2. *Confirmation.* The model's answer is measured: the step at that batch must fit (its
   peak measured as `rematlab.plan` measures a plan; with remat, the peak of the floor
   plan, the smallest any plan reaches) and at one more sample it must not. Secant steps
   on measured peaks correct the model's answer, then the search gallops by measurement
   until both hold, so the result is exact whatever the model's error: `batch` fits,
   `batch + 1` does not. With remat, the plan kept is then the fastest within the budget
   at that batch (`rematlab.plan`'s choice, verified).
3. *Throughput.* Each result is timed as a full training step (forward, loss, backward,
   optimizer) after warm-up, both cases interleaved round by round (a busy machine slows
   them alike), median of repeats with their spread; throughput is samples per second at
   the median.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import nn

from rematlab.core.batch import Batch, check_batch, resized, tensors, to_device
from rematlab.core.checks import bounded
from rematlab.core.clocks import Clock
from rematlab.core.guard import Evidence
from rematlab.core.recipe import Step
from rematlab.core.steps import is_oom, preserved
from rematlab.core.timer import Timer, Timing, Turns
from rematlab.exceptions import ConfigError, InfeasibleBudgetError
from rematlab.measurement.spec import MAX_REPEATS
from rematlab.planning.batchfit import CASES, BatchFit, BatchSearch
from rematlab.planning.bisect import confirmed, largest, scaled
from rematlab.planning.budget import checked, resident, resolve_budget
from rematlab.planning.options import PlanOptions, request
from rematlab.planning.planner import Planning, prepare
from rematlab.planning.predicted import card_budget, room
from rematlab.planning.verify import step_peak
from rematlab.plans.fixed import none_plan
from rematlab.plans.plan import ChainCosts, Plan
from rematlab.plans.simulate import simulate
from rematlab.plans.solver import solve
from rematlab.preflight.targets import resolve_target
from rematlab.remat.strategies import apply

MAX_BATCH = 1 << 20


class _Searcher:
    """The model, its batch factory and the budget; measurements are cached per batch."""

    def __init__(self, model: nn.Module, make: Callable[[int], Batch], start: int, limit: int,
                 budget: str | int, step: Step, options: PlanOptions) -> None:
        self.model, self.make, self.start, self.limit = model, make, start, limit
        self.step, self.options = step, options
        # predicted for a resolved target, nothing measured (`rematlab.preflight`)
        self.target = options.target if options.predict else None
        self.device = next(tensors(make(1))).device
        self.budget = (card_budget(budget, self.target)  # batches come later
                       or resolve_budget(budget, self.device, resident(model)))
        # a predicted batch keeps the pre-flight margin free: it is not verified
        self.room = room(self.budget.nbytes) if self.target else self.budget.nbytes
        self.plannings: dict[int, Planning] = {}
        for b in (start, 2 * start):
            self.planning(b)
        self.layers = self.plannings[start].structure.kind == "layers"
        self.seen: dict[tuple[str, int], int | None] = {}
        self.chosen: dict[int, Plan] = {}
        self.evidence: Evidence | None = None

    def planning(self, batch: int) -> Planning:
        """The model profiled and solved at `batch` on the device, cached without its batch:
        batches are made when measured, so none is alive beside another's measurement."""
        if batch not in self.plannings:
            planning = prepare(self.model, self.make(batch), self.options, step=self.step)
            planning.batch = None
            self.plannings[batch] = planning
        return self.plannings[batch]

    def costs(self, batch: int) -> ChainCosts:
        """Costs at `batch`, interpolated between the two profiled batches nearest to it."""
        a, b = sorted(sorted(self.plannings, key=lambda k: (abs(k - batch), -k))[:2])
        return scaled(self.plannings[a].costs, a, self.plannings[b].costs, b, batch)

    def estimate(self, case: str, rounds: int = 2) -> int:
        """The model's largest batch, re-profiled near its answer until it stands: affine
        extrapolation from small batches misses what does not scale linearly (kernels'
        scratch memory, which phase of the step peaks)."""
        def fits(b: int) -> bool:
            return self.modelled(case, b) <= self.room

        guess = largest(fits, self.start, self.limit)
        for _ in range(rounds):
            if guess < 1 or guess in self.plannings:
                break
            try:
                self.planning(guess)
            except Exception as exc:  # the device cannot even profile it: measure instead
                if is_oom(exc):
                    break
                raise
            nxt = largest(fits, guess, self.limit)
            if nxt == guess:
                break
            guess = nxt
        return guess

    def modelled(self, case: str, batch: int) -> int:
        """The cost model's step peak at `batch`: without remat, or the solver's floor."""
        costs = self.costs(batch)
        if case == "none":
            return simulate(none_plan(costs.n), costs)[0]
        return solve(costs, layers=self.layers).min_peak

    def peak(self, case: str, batch: int) -> int | None:
        """The measured step peak at `batch` without remat, or of the floor plan (the
        smallest peak any plan reaches, so the optimal case fits iff it does); None when
        the step ran out of memory. Cached."""
        key = (case, batch)
        if key not in self.seen:
            self.seen[key] = self._measure(case, batch)
        return self.seen[key]

    def _measure(self, case: str, batch: int) -> int | None:
        try:
            if case == "none":
                costs = self.costs(batch)
                return step_peak(self.model, self.model, self.make(batch), costs, self.step)
            planning = self.planning(batch)
            floor = planning.solution.plan_for(planning.solution.min_peak)
            return self._with_batch(planning, batch, lambda: planning.measure(floor))
        except Exception as exc:
            if is_oom(exc):
                return None
            raise

    def _with_batch(self, planning: Planning, batch: int, work: Callable[[], Any]) -> Any:
        planning.batch = self.make(batch)
        try:
            return work()
        finally:
            planning.batch = None

    def fits(self, case: str, batch: int) -> bool:
        peak = self.peak(case, batch)
        return peak is not None and peak <= self.budget.nbytes

    def corrected(self, case: str, estimate: int, rounds: int = 4) -> int:
        """The measured peak is piecewise affine in the batch (the largest of a few phases'
        peaks; for the floor, the smallest of a few plans'): secant steps on measured peaks,
        from the model's estimate and slope, put the guess within a sample or two of the
        answer."""
        b = estimate
        slope = self.modelled(case, b + 1) - self.modelled(case, b)
        previous: tuple[int, int] | None = None
        for _ in range(rounds):
            peak = self.peak(case, b)
            if peak is None or b < 1:
                break
            if previous is not None:
                slope = (peak - previous[1]) / (b - previous[0])
            if slope <= 0:
                break
            previous = (b, peak)
            nxt = max(1, min(self.limit, b + int((self.budget.nbytes - peak) // slope)))
            if nxt == b:
                break
            b = nxt
        return b

    def predicted(self, case: str) -> BatchFit:
        """The cost model's largest batch (costs interpolated between the two profiled
        batches: a fake profile's bytes are affine in the batch), with the predicted step
        time of its plan (`optimal`: the fastest within the budget) and the predicted peak
        one sample above: nothing is measured."""
        batch = self.estimate(case, rounds=0)  # fake profiles are affine in the batch
        if self.target is not None and self.target.kind == "cuda":
            return self._chosen_fit(case, batch)
        if batch < 1:
            return BatchFit(case=case, batch=0, peak=None, over=self.modelled(case, 1),
                            estimate=0, measured=0, at_limit=False)
        costs = self.costs(batch)
        chosen = (none_plan(costs.n) if case == "none" else
                  solve(costs, layers=self.layers).plan_for(self.room))
        peak, step = simulate(chosen, costs)
        return BatchFit(case=case, batch=batch, peak=peak,
                        over=None if batch >= self.limit else self.modelled(case, batch + 1),
                        estimate=batch, measured=0, at_limit=batch >= self.limit,
                        plan=chosen.describe() if case == "optimal" else None, step_s=step,
                        throughput=batch / step if step > 0 else None)

    def _chosen_fit(self, case: str, batch: int) -> BatchFit:
        """On a GPU target, down from `batch` until its step fits as `Planning.choose` fits
        it — the band's upper end within the budget: of the step replayed through the
        caching allocator on one card, of one rank's (run on a fake group, or simulated when
        not verifying) under a layout — by the share it overshoots; the plan, peak and step
        time are that batch's own profile's, so `choose` at the batch found agrees."""
        while batch >= 1:
            planning = self.planning(batch)

            def pick(p: Planning = planning) -> tuple[Plan | None, int]:
                if case == "none":
                    plain = none_plan(p.costs.n)
                    upper = p.band(plain).upper
                    return (plain if upper <= self.budget.nbytes else None), upper
                try:
                    return p.choose(self.budget.nbytes), self.budget.nbytes
                except InfeasibleBudgetError as exc:
                    return None, exc.min_peak
            chosen, upper = self._with_batch(planning, batch, pick)
            if chosen is not None:
                peak, step = simulate(chosen, planning.costs)
                return BatchFit(case=case, batch=batch, peak=peak, over=None, estimate=batch,
                                measured=0, at_limit=batch >= self.limit,
                                plan=chosen.describe() if case == "optimal" else None,
                                step_s=step, throughput=batch / step if step > 0 else None)
            batch = min(batch - 1, batch * self.budget.nbytes // max(1, upper))
        return BatchFit(case=case, batch=0, peak=None, over=self.modelled(case, 1),
                        estimate=0, measured=0, at_limit=False)

    def find(self, case: str) -> BatchFit:
        estimate = self.estimate(case)
        before = len(self.seen)
        batch = confirmed(lambda b: self.fits(case, b), self.corrected(case, estimate),
                          self.limit)
        peak, chosen = (self.peak(case, batch) if batch else None), None
        if batch and case == "optimal":  # the fastest plan within the budget at that batch
            planning = self.planning(batch)
            chosen = self._with_batch(planning, batch,
                                      lambda: planning.choose(self.budget.nbytes))
            self.chosen[batch] = chosen
            peak = chosen.measured_peak
        over = None if batch >= self.limit else self.peak(case, batch + 1)
        return BatchFit(case=case, batch=batch, peak=peak, over=over, estimate=estimate,
                        measured=len(self.seen) - before, at_limit=batch >= self.limit,
                        plan=chosen.describe() if chosen is not None else None)

    def timed(self, found: list[BatchFit], warmup: int, repeats: int) -> list[BatchFit]:
        """Each case's step at its batch, timed side by side (`side_by_side`)."""
        runs = {}
        for fit in found:
            if fit.batch == 0:
                continue
            chosen = self.chosen.get(fit.batch) if fit.case == "optimal" else None
            run = self.model if chosen is None else apply(
                self.model, chosen, blocks=self.options.blocks,
                example_input=self.make(fit.batch))
            runs[fit.case] = (run, lambda b=fit.batch: self.make(b))
        timing = side_by_side(self.model, runs, self.step, warmup, repeats)
        self.evidence = timing.evidence
        timed = []
        for fit in found:
            if fit.case in runs:
                median = timing.median(fit.case)
                fit = replace(fit, step_s=median, step_iqr=timing.iqr(fit.case) if repeats > 1
                              else 0.0, repeats=repeats, throughput=fit.batch / median)
            timed.append(fit)
        return timed


def side_by_side(model: nn.Module, runs: dict[str, tuple[nn.Module, Callable[[], Batch]]],
                 step: Step, warmup: int, repeats: int) -> Timing:
    """The user's training steps (`Step`: micro-batches, autocast, clipping, the optimizer
    step) of each run on its batch,
    timed side by side by the one timer (`rematlab.core.timer`): interleaved rounds under
    the guard. A run's batch is made when its turn comes, outside the clock, and never two
    are alive at once (`Turns`). `model`'s weights, gradients, buffers and the RNG are restored
    afterwards."""
    snapshot = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    opt = step.make_optimizer(model.parameters())

    batch = Turns({name: make for name, (_, make) in runs.items()})

    def work(name: str, run: nn.Module) -> Callable[[Clock], dict[str, float]]:
        def one(clock: Clock) -> dict[str, float]:
            return step.train_step(model, batch(name), run=run, optimizer=opt, clock=clock)
        return one

    try:
        with preserved(model):
            return Timer(device).run({name: work(name, run) for name, (run, _)
                                      in runs.items()}, repeats, warmup=max(1, warmup))
    finally:
        model.load_state_dict(snapshot)


def batches_from(example: Batch | Callable[[int], Batch], device: torch.device | None
                 ) -> tuple[Callable[[int], Batch], int]:
    """A factory batch size -> batch on `device`, and the batch size to start from: the
    example's own, or 8 for a factory."""
    if callable(example) and not isinstance(example, torch.Tensor):
        def made(size: int) -> Batch:
            batch = example(size)
            check_batch(batch)
            return to_device(batch, device) if device is not None else batch
        return made, 8
    check_batch(example)
    base = to_device(example, device) if device is not None else example
    first = next(tensors(base))
    if first.dim() == 0:
        raise ConfigError("the example batch's first tensor has no batch dimension")
    return (lambda size: resized(base, size)), max(2, first.shape[0])


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """How `max_batch` searches, beside how each batch is planned (`PlanOptions`): which
    `cases` ('none', 'optimal'), the batch the cost model is profiled at (`start`, and twice
    it; default: the example's batch size, or 8 for a factory), the largest batch tried
    (`limit`), and the timing of each result (`warmup`, `repeats`; 0 skips it)."""

    cases: tuple[str, ...] = CASES
    start: int | None = None
    limit: int = MAX_BATCH
    warmup: int = 2
    repeats: int = 5

    def __post_init__(self) -> None:
        if isinstance(self.cases, str) or not isinstance(self.cases, (tuple, list)):
            raise ConfigError(f"cases must be a list of {', '.join(CASES)}, got {self.cases!r}")
        object.__setattr__(self, "cases", tuple(self.cases))
        unknown = set(self.cases) - set(CASES)
        if unknown or not self.cases:
            raise ConfigError(f"unknown case(s) {sorted(unknown)}; choose from "
                              f"{', '.join(CASES)}")
        bounded("limit", self.limit, MAX_BATCH)
        if self.start is not None and bounded("start", self.start, MAX_BATCH) > self.limit:
            raise ConfigError(f"start {self.start} is above the limit {self.limit}: the "
                              "search goes up from start, never past the limit")
        bounded("warmup", self.warmup, MAX_REPEATS, low=0)
        bounded("repeats", self.repeats, MAX_REPEATS, low=0)


SEARCH_NAMES = frozenset(f.name for f in fields(SearchOptions))


def max_batch(model: nn.Module, example: Batch | Callable[[int], Batch], budget: str | int,
              options: PlanOptions | None = None, *, search: SearchOptions | None = None,
              step: Step | None = None, **keywords: Any) -> BatchSearch:
    """The largest batch whose training step fits `budget` (bytes, '8GiB' or 'auto'), for
    each of the search's cases ('none': the model as it is; 'optimal': the fastest plan
    within the budget at that batch), with measured peak, step time and throughput (see the
    module docstring).

    `example` is a batch of any form (its tensors are resized along their first dimension) or
    a factory `size -> batch`. `search` (`SearchOptions`) says how the batch is searched and
    timed, `options` (`PlanOptions`) how each batch is planned (`ops`: op-level options, kept
    where both profiled batches offer them), `step` the user's training step; the fields of
    either options object are also keywords (`repeats` is the search's). With `predict`,
    nothing runs (`rematlab.preflight`): the batches are the cost model's for `target`,
    interpolated between fake profiles at `start` and twice it, and each step time is the
    target's roofline prediction."""
    budget = checked(budget)
    if search is not None and not isinstance(search, SearchOptions):
        raise ConfigError(f"search must be a SearchOptions, got {type(search).__name__}")
    searched = {k: keywords.pop(k) for k in list(keywords) if k in SEARCH_NAMES}
    search = replace(search or SearchOptions(), **searched)
    opts, user_step = request(options, step, keywords)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"max_batch() needs an nn.Module, got {type(model).__name__}")
    dev = torch.device(opts.device) if opts.device is not None else None
    if dev is None:
        dev = next((p.device for p in model.parameters()), None)
    # predicted batches stay what they are (meta tensors, shapes only): nothing is moved
    make, first = batches_from(example, None if opts.predict else dev)
    start = first if search.start is None else search.start
    if start < (1 if opts.predict else 2):
        raise ConfigError(f"start must be at least {1 if opts.predict else 2} (profiled with "
                          f"twice it), got {start}")
    t0 = time.perf_counter()
    if opts.predict:
        opts = replace(opts, target=resolve_target(opts.target,
                                                   dev.type if dev is not None else "cpu"))
    searcher = _Searcher(model, make, min(start, search.limit), search.limit, budget,
                         user_step, opts)
    found = [searcher.predicted(case) if opts.predict else searcher.find(case)
             for case in search.cases]
    t1 = time.perf_counter()
    if search.repeats and not opts.predict:
        found = searcher.timed(found, search.warmup, search.repeats)
    return BatchSearch(searcher.budget, found, t1 - t0, time.perf_counter() - t1,
                       searcher.evidence, opts.target.name if opts.predict else None)
