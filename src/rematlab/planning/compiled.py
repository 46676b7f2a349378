"""A compiled plan's choice among measured candidates: rematlab's compiled plan for the budget,
torch.compile's own activation memory budget alone (a few fractions), and a faster rematlab
plan with a fraction inside its kept blocks (`rematlab.remat.compiled_budget`).

A fraction is not a byte budget (its peak is not monotone in it, and it can exceed its own
limit), so every candidate's compiled step is run: its peak measured as a compiled plan's is
(`verify.step_peak` with the allocator's view: the tracker cannot see into compiled code), and
its step time as a ratio to the eager step keeping everything, timed side by side in
interleaved rounds (`core.timer.Timer`, medians and the ratio's spread). Candidates are
compared by those ratios, each measured against the same eager reference. Each candidate is
compiled and measured alone, after `torch._dynamo.reset()`: dynamo would hand a model's second
planned copy the first one's graph (`compiled_budget`), so two compiled candidates cannot share
a timing run. Measurements are cached per `Planning`, so a larger budget only adds
candidates. A candidate dynamo or the partitioner refuses is dropped with a warning, not the
plan refused.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import nn

from rematlab.core.batch import one_tensor, tensors
from rematlab.core.recipe import Step
from rematlab.core.steps import preserved
from rematlab.core.timer import profile_timer, timed, watched
from rematlab.planning.verify import step_peak
from rematlab.plans.fixed import none_plan
from rematlab.plans.plan import ChainCosts, Plan
from rematlab.plans.solver import Solution
from rematlab.remat.block import compiled, compiling
from rematlab.remat.compiled_budget import global_fraction, settings
from rematlab.remat.layers import LayerRemat, attach
from rematlab.remat.outer import one_pass
from rematlab.remat.strategies import RematChain
from rematlab.remat.structure import Structure

FRACTIONS = (0.0, 0.5, 1.0)  # each costs a compile and a timing run: a few, 0 and 1 among them
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
    """The measured candidates of one compiled `Planning` (module docstring)."""

    planning: Planned
    fractions: tuple[float, ...] = FRACTIONS
    results: dict[str, Measured | None] = field(default_factory=dict)  # None: refused
    plans: dict[str, Plan] = field(default_factory=dict)  # what was measured, by key
    compile_seconds: float = 0.0

    def fraction_plans(self) -> list[Plan]:
        """Keeping every block under each fraction; the global budget's is the plain plan."""
        n = self.planning.costs.n
        return [replace(none_plan(n), fraction=None if f == global_fraction() else f)
                for f in self.fractions]

    def measured(self, plan: Plan) -> Measured | None:
        """`plan`'s compiled step, measured once; None where torch refused to compile it."""
        key = plan.describe()
        if key not in self.results:
            self.results[key] = self._measure(plan)
            self.plans[key] = plan
        return self.results[key]

    def peak(self, plan: Plan) -> int | None:
        got = self.measured(plan)
        return None if got is None else got.peak

    def fits(self, plans: list[Plan], limit: int) -> list[Plan]:
        return [p for p in plans if (self.peak(p) or limit + 1) <= limit]

    def floor(self) -> int | None:
        """The smallest peak of the fraction candidates (None when none compiled)."""
        peaks = [p for p in map(self.peak, self.fraction_plans()) if p is not None]
        return min(peaks) if peaks else None

    def _measure(self, plan: Plan) -> Measured | None:
        planning = self.planning
        st, step = planning.structure, planning.step
        chosen = replace(plan, compiled=True)
        if st.kind == "layers":
            owner: nn.Module = planning.model
            planned, eager = attach(owner, LayerRemat(st.blocks, chosen)), owner
            batch = planning.batch
        else:
            planned = owner = RematChain(st.blocks, chosen)
            eager = RematChain(st.blocks, none_plan(len(st.blocks)))
            batch = one_tensor(planning.batch)
        t0 = time.perf_counter()
        torch._dynamo.reset()  # its own graphs, not another candidate's (module docstring)
        try:
            with compiling():
                run = compiled(planned)
                with preserved(owner):
                    step.micro_batch(run, batch)
                peak = step_peak(owner, run, batch, planning.costs, step, tensors_seen=False)
        except Exception as exc:  # dynamo, the partitioner, a budget torch refuses
            warnings.warn(f"compiled candidate {plan.describe()!r} dropped: torch.compile "
                          f"refused it ({type(exc).__name__}: {str(exc)[:160]})",
                          RuntimeWarning, stacklevel=2)
            return None
        finally:
            self.compile_seconds += time.perf_counter() - t0
        ratio, spread = self._ratio(owner, run, eager, batch)
        return Measured(peak, ratio, spread)

    def _ratio(self, owner: nn.Module, run: Callable, eager: Callable, batch: object
               ) -> tuple[float, float]:
        step = self.planning.step
        works = {"compiled": timed(lambda: one_pass(owner, run, batch, step)),
                 "eager": timed(lambda: one_pass(owner, eager, batch, step))}
        timer = profile_timer(next(tensors(self.planning.batch)).device)
        with watched("a compiled candidate's step time"), preserved(owner):
            timing = timer.run(works, ROUNDS, warmup=1)
        ratio = timing.median("compiled") / timing.median("eager")
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
