"""A compiled plan's choice among measured candidates: rematlab's compiled plan for the budget,
torch.compile's own activation memory budget alone (a few fractions), and a faster rematlab
plan with a fraction inside its kept blocks (`rematlab.remat.compiled_budget`).

A fraction is not a byte budget (its peak is not monotone in it, and it can exceed its own
limit), so every candidate's compiled step is run: its peak measured as a compiled plan's is
(`verify.step_peak` with the allocator's view: the tracker cannot see into compiled code),
and the candidates that fit timed side by side in interleaved rounds (`core.timer.Timer` with
several works, medians), so that the fastest is chosen from one comparison. Each candidate
compiles once per `Planning`; its compiled step is kept for later choices, so a larger budget
only adds candidates. A candidate dynamo or the partitioner refuses (a region that does not
cover a graph, a graph break inside it) is dropped with a warning, not the plan refused.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from torch import nn

from rematlab.core.batch import one_tensor, tensors
from rematlab.core.steps import preserved
from rematlab.core.timer import profile_timer, timed, watched
from rematlab.planning.verify import step_peak
from rematlab.plans.fixed import none_plan
from rematlab.plans.plan import Plan
from rematlab.remat.block import compiled, compiling
from rematlab.remat.compiled_budget import global_fraction, settings
from rematlab.remat.layers import LayerRemat, attach
from rematlab.remat.outer import one_pass
from rematlab.remat.strategies import RematChain

if TYPE_CHECKING:
    from rematlab.planning.planner import Planning

FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
COMBINED = (0.5, 0.0)  # tried inside the kept blocks of the plan just faster than the choice
ROUNDS = 5  # interleaved timing rounds of the candidates that fit


@dataclass
class _Run:
    owner: nn.Module
    run: Callable
    peak: int


@dataclass
class CompiledCandidates:
    """The measured candidates of one compiled `Planning` (module docstring)."""

    planning: Planning
    fractions: tuple[float, ...] = FRACTIONS
    runs: dict[str, _Run | None] = field(default_factory=dict)  # None: refused by torch
    compile_seconds: float = 0.0

    def fraction_plans(self) -> list[Plan]:
        """Keeping every block under each fraction; the global budget's is the plain plan."""
        n = self.planning.costs.n
        return [replace(none_plan(n), fraction=None if f == global_fraction() else f)
                for f in self.fractions]

    def peak(self, plan: Plan) -> int | None:
        """`plan`'s measured compiled step peak; None where torch refused to compile it."""
        key = plan.describe()
        if key not in self.runs:
            self.runs[key] = self._compile(plan)
        run = self.runs[key]
        return None if run is None else run.peak

    def fits(self, plans: list[Plan], limit: int) -> list[Plan]:
        return [p for p in plans if (self.peak(p) or limit + 1) <= limit]

    def floor(self) -> int | None:
        """The smallest peak of the fraction candidates (None when none compiled)."""
        peaks = [p for p in map(self.peak, self.fraction_plans()) if p is not None]
        return min(peaks) if peaks else None

    def fastest(self, plans: list[Plan]) -> tuple[Plan, dict[str, float]]:
        """The fastest of `plans` (each compiled and measured), timed side by side: its
        plan and every candidate's median seconds."""
        planning = self.planning
        batch = planning.batch if planning.structure.kind == "layers" \
            else one_tensor(planning.batch)
        works = {p.describe(): self._work(self.runs[p.describe()], batch) for p in plans}
        timer = profile_timer(next(tensors(planning.batch)).device)
        with watched("the compiled candidates' step times"):
            timing = timer.run(works, ROUNDS, warmup=1)
        medians = {name: timing.median(name) for name in works}
        return min(plans, key=lambda p: medians[p.describe()]), medians

    def _work(self, run: _Run, batch: object) -> Callable:
        step = self.planning.step
        return timed(lambda: one_pass(run.owner, run.run, batch, step))

    def _compile(self, plan: Plan) -> _Run | None:
        """`plan`'s model compiled, warmed (forward and backward compiled outside any
        measurement) and its step peak measured."""
        planning = self.planning
        st, step = planning.structure, planning.step
        chosen = replace(plan, compiled=True)
        if st.kind == "layers":
            owner: nn.Module = planning.model
            planned = attach(owner, LayerRemat(st.blocks, chosen))
            batch = planning.batch
        else:
            planned = owner = RematChain(st.blocks, chosen)
            batch = one_tensor(planning.batch)
        t0 = time.perf_counter()
        try:
            with compiling():
                run = compiled(planned)
                with preserved(owner):
                    step.micro_batch(run, batch)
                peak = step_peak(owner, run, batch, planning.costs, step, tensors_seen=False)
        except Exception as exc:  # dynamo, the partitioner, a region torch refuses
            warnings.warn(f"compiled candidate {plan.describe()!r} dropped: torch.compile "
                          f"refused it ({type(exc).__name__}: {str(exc)[:160]})",
                          RuntimeWarning, stacklevel=2)
            return None
        finally:
            self.compile_seconds += time.perf_counter() - t0
        return _Run(owner, run, peak)


def choose_compiled(candidates: CompiledCandidates, block: Plan | None, limit: int
                    ) -> tuple[Plan, int] | None:
    """The fastest measured candidate within `limit` (module docstring): `block`, rematlab's
    verified compiled plan for it (None: none fits), the fractions alone, and the frontier
    plan just faster than `block` under the first of `COMBINED` that fits. Returns the plan
    (its fraction and compile settings set) and its measured peak; None when nothing fits."""
    planning = candidates.planning
    frontier = planning.solution.frontier
    pool = candidates.fits(candidates.fraction_plans(), limit)
    if block is not None:  # measured through `candidates` by the planner's verification
        pool.append(block)
    at = next((i for i, p in enumerate(frontier) if block is not None
               and p.items == block.items), -1)
    if at + 1 < len(frontier):
        for f in COMBINED:
            combined = candidates.fits([replace(frontier[at + 1], fraction=f)], limit)
            if combined:
                pool += combined
                break
    pool = [p for p in pool if candidates.peak(p) is not None]
    if not pool:
        return None
    best, _ = candidates.fastest(pool)
    return (replace(best, compile_settings=settings(best.fraction)),
            candidates.peak(best) or 0)
