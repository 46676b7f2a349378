"""What the largest-batch search (`rematlab.planning.maxbatch`) finds: per case, the batch, its
peak, its step time and throughput; and the one-line verdict on whether remat pays."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rematlab.core.guard import Evidence
from rematlab.planning.budget import DeviceBudget

CASES = ("none", "optimal")


@dataclass(frozen=True)
class BatchFit:
    """The largest batch found for one case (`none`: no remat; `optimal`: the fastest plan
    within the budget at that batch), measured.

    `batch` fits and `batch + 1` does not (`over`: its measured peak, for `optimal` that of
    its floor plan, the smallest any plan reaches), unless `at_limit` (the search stopped
    at its upper limit). `estimate` is the cost model's answer before confirmation;
    `measured` how many batch sizes were measured to confirm it. `step_s` is the median of
    `repeats` timed steps after warm-up, `step_iqr` their spread; `throughput` samples per
    second at the median."""

    case: str
    batch: int
    peak: int | None
    over: int | None
    estimate: int
    measured: int
    at_limit: bool
    plan: str | None = None
    step_s: float | None = None
    step_iqr: float | None = None
    repeats: int = 0
    throughput: float | None = None


@dataclass(frozen=True)
class BatchSearch:
    """Both cases at one budget; `search_s` is the wall time of finding the batches, `timing_s`
    of timing them."""

    budget: DeviceBudget
    fits: list[BatchFit]
    search_s: float
    timing_s: float
    evidence: Evidence | None = None  # the guard's, over the side-by-side timing
    target: str | None = None  # predicted for this target: nothing was measured

    def fit(self, case: str) -> BatchFit:
        return next(f for f in self.fits if f.case == case)

    def verdict(self) -> str:
        """One line: how much larger a batch the plan allows, at what throughput."""
        cases = {f.case: f for f in self.fits}
        if set(cases) != set(CASES):
            return ""
        none, best = cases["none"], cases["optimal"]
        if best.batch == 0:
            return "not even one sample fits the budget, with or without remat"
        if best.batch <= none.batch:
            return (f"remat enables no larger batch ({none.batch}); without it the step is "
                    f"not slowed")
        gain = f"remat fits {best.batch} samples per step against {none.batch}"
        if none.batch == 0:
            return gain + ": without it not even one sample fits"
        gain += f" (+{best.batch / none.batch - 1:.0%})"
        if best.throughput and none.throughput:
            ratio = best.throughput / none.throughput
            return gain + (f", at {ratio:.2f}x the throughput of the largest batch without "
                           f"it: remat {'pays' if ratio > 1 else 'does not pay'} in "
                           f"samples/s")
        return gain

    def to_dict(self) -> dict:
        return {"budget": self.budget.nbytes, "budget_source": self.budget.how,
                "search_s": self.search_s, "timing_s": self.timing_s,
                "fits": [asdict(f) for f in self.fits],
                "timing": (f"predicted for {self.target}: fake-tensor costs, roofline step "
                           "times, nothing measured" if self.target else
                           "full training steps (forward, loss, backward, optimizer) after "
                           "warm-up, side by side in interleaved rounds under the "
                           "interference guard; median and IQR of repeats, device "
                           "synchronised"),
                **(self.evidence.columns() if self.evidence else {})}
