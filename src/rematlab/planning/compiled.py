"""A compiled plan's choice among measured candidates: rematlab's compiled plan for the budget,
torch.compile's own activation memory budget alone (a few fractions), and a faster rematlab
plan with a fraction inside its kept blocks (`rematlab.remat.compiled_budget`).

A fraction is not a byte budget (its peak is not monotone in it, and it can exceed its own
limit), so every candidate's compiled step is run: its peak measured as a compiled plan's is
(`verify.measure_planned` with the allocator's view: the tracker cannot see into compiled
code), and its step time as a ratio to the eager step keeping everything, timed side by side
in interleaved rounds (`core.timer.Timer`, medians and the ratio's spread). Candidates are
compared by those ratios, each measured against the same eager reference. Each candidate is
compiled and measured alone, after `torch._dynamo.reset()`: dynamo would hand a model's second
planned copy the first one's graph (`compiled_budget`), so two compiled candidates cannot share
a timing run. Measurements are cached per `Planning`, so a larger budget only adds
candidates; a candidate is timed only once a budget it fits asks for it. A candidate dynamo or
the partitioner refuses is dropped with a warning, not the plan refused.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from torch import nn

from rematlab.core.batch import tensors
from rematlab.core.recipe import Step
from rematlab.core.steps import preserved
from rematlab.core.timer import profile_timer, timed, watched
from rematlab.planning.options import FRACTIONS
from rematlab.planning.verify import PlannedStep, measure_planned, planned_step
from rematlab.plans.fixed import none_plan
from rematlab.plans.plan import ChainCosts, Plan
from rematlab.plans.solver import Solution
from rematlab.remat.compiled_budget import fresh_graphs, global_fraction, settings
from rematlab.remat.outer import one_pass
from rematlab.remat.structure import Structure

COMBINED = (0.5, 0.0)  # tried inside the kept blocks of the plan just faster than the choice
ROUNDS = 5  # interleaved rounds of a candidate against the eager reference


class Planned(Protocol):
    """What a compiled candidate is measured from: a `Planning`'s model, structure, batch,
    step, costs and solution."""

    model: nn.Module
    structure: Structure
    batch: Any
    step: Step
    costs: ChainCosts
    solution: Solution


@dataclass(frozen=True)
class Measured:
    """A compiled candidate's step: its peak, and its time over the eager step keeping
    everything (median of interleaved rounds) with the ratio's relative spread."""

    peak: int
    ratio: float
    spread: float


@dataclass
class CompiledCandidates:
    """The measured candidates of one compiled `Planning` (module docstring). A candidate's
    peak is measured when it is first asked for; its time only when it fits the budget it
    was asked for (its graph is then still compiled), or when a later budget asks for it (it
    is compiled again): a candidate that fits no budget asked is never timed."""

    planning: Planned
    fractions: tuple[float, ...] = FRACTIONS
    peaks: dict[str, int | None] = field(default_factory=dict)  # None: torch refused it
    timings: dict[str, tuple[float, float]] = field(default_factory=dict)  # ratio, spread
    plans: dict[str, Plan] = field(default_factory=dict)  # what was measured, by key
    compile_seconds: float = 0.0

    def fraction_plans(self) -> list[Plan]:
        """Keeping every block under each fraction; the global budget's is the plain plan."""
        n = self.planning.costs.n
        return [replace(none_plan(n), fraction=None if f == global_fraction() else f)
                for f in self.fractions]

    def peak(self, plan: Plan, limit: int | None = None) -> int | None:
        """`plan`'s measured compiled peak (None where torch refused to compile it), timed
        as well when it fits `limit`."""
        key = plan.describe()
        if key not in self.peaks:
            self.plans[key] = plan
            self.peaks[key] = self._measure(plan, limit)
        return self.peaks[key]

    def measured(self, plan: Plan) -> Measured | None:
        """`plan`'s compiled step, its peak and its time over the eager step; None where torch
        refused to compile it."""
        peak = self.peak(plan)
        if peak is None:
            return None
        if plan.describe() not in self.timings:
            self._measure(plan, peak)
        return Measured(peak, *self.timings[plan.describe()])

    def fits(self, plans: list[Plan], limit: int) -> list[Plan]:
        return [p for p in plans if (self.peak(p, limit) or limit + 1) <= limit]

    def floor(self) -> int | None:
        """The smallest peak of the fraction candidates (None when none compiled)."""
        peaks = [p for p in map(self.peak, self.fraction_plans()) if p is not None]
        return min(peaks) if peaks else None

    def _measure(self, plan: Plan, limit: int | None) -> int | None:
        """Compile `plan` alone, measure its peak, and time it if it fits `limit`."""
        planning = self.planning
        planned = planned_step(planning.structure, planning.model, replace(plan, compiled=True),
                               planning.batch)
        t0 = time.perf_counter()
        fresh_graphs()  # its own graphs, not another candidate's (module docstring)
        try:
            peak = measure_planned(planned, planning.costs, planning.step)
        except Exception as exc:  # dynamo, the partitioner, a budget torch refuses
            warnings.warn(f"compiled candidate {plan.describe()!r} dropped: torch.compile "
                          f"refused it ({type(exc).__name__}: {str(exc)[:160]})",
                          RuntimeWarning, stacklevel=2)
            return None
        finally:
            self.compile_seconds += time.perf_counter() - t0
        if limit is not None and peak <= limit:
            self.timings[plan.describe()] = ratio_to_eager(planned, planning.step)
        return peak


def ratio_to_eager(planned: PlannedStep, step: Step, rounds: int = ROUNDS
                   ) -> tuple[float, float]:
    """`planned`'s step time over its eager step keeping everything: medians of interleaved
    rounds of the one timer, and the ratio's relative spread (the larger IQR/median)."""
    owner, batch = planned.owner, planned.batch
    works = {"planned": timed(lambda: one_pass(owner, planned.run, batch, step)),
             "eager": timed(lambda: one_pass(owner, planned.eager, batch, step))}
    timer = profile_timer(next(tensors(batch)).device)
    with watched("a planned step's time against eager"), preserved(owner):
        timing = timer.run(works, rounds, warmup=1)
    ratio = timing.median("planned") / timing.median("eager")
    spread = max(timing.iqr(name) / timing.median(name) for name in works)
    return ratio, spread


def choose_compiled(candidates: CompiledCandidates, block: Plan | None, limit: int
                    ) -> tuple[Plan, int] | None:
    """The fastest measured candidate within `limit` (module docstring): `block`, rematlab's
    verified compiled plan for it (None: none fits; measured through `candidates` by the
    planner), the fractions alone, the frontier plan just faster than `block` under the first
    of `COMBINED` (among the fractions) that fits, and any candidate an earlier choice
    measured that fits. Returns the plan (its fraction and compile settings set) and its
    measured peak; None when nothing fits."""
    frontier = candidates.planning.solution.frontier
    candidates.fits(candidates.fraction_plans(), limit)  # measured, kept among the plans
    at = next((i for i, p in enumerate(frontier) if block is not None
               and p.items == block.items), -1)
    if at + 1 < len(frontier):
        for f in (f for f in COMBINED if f in candidates.fractions):
            if candidates.fits([replace(frontier[at + 1], fraction=f)], limit):
                break
    # every candidate measured so far that fits: a larger budget only adds candidates
    pool = candidates.fits(list(candidates.plans.values()), limit)
    if not pool:
        return None
    best = min(pool, key=lambda p: candidates.measured(p).ratio)
    return (replace(best, compile_settings=settings(best.fraction)),
            candidates.peak(best) or 0)
