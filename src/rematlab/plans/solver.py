"""Optimal checkpointing of a chain under a memory limit: a dynamic programme, no torch.

In the spirit of rotor (Beaumont et al., "Optimal checkpointing for heterogeneous chains",
2019): for every sub-chain [s, t), every memory level m and whether the sub-chain's input is
already held, the fastest schedule either runs block s keeping its activations and solves
[s+1, t), or checkpoints a segment [s, k) — keeping only its input — solves [k, t), and later
recomputes [s, k) under its own optimal (possibly again checkpointed) schedule. That recursion
is exactly `plan.need`, so the solver's plans and the simulator agree by construction.

Memory is discretised in `unit` bytes; every memory term is rounded up, so a plan the solver
calls feasible at level m needs at most m * unit bytes in the simulator.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from rematlab.core.units import infeasible
from rematlab.exceptions import ConfigError
from rematlab.plans.plan import (
    ChainCosts,
    Item,
    Plan,
    Segment,
    checkpoint_terms,
    keep_terms,
    need,
    step_peak,
)

_INF = float("inf")


@dataclass
class Solution:
    """DP tables for one chain: pick a plan for any memory level without solving again."""

    costs: ChainCosts
    unit: int
    levels: int
    table: dict[tuple[int, int, int], np.ndarray]
    choice: dict[tuple[int, int, int], np.ndarray]

    @property
    def min_peak(self) -> int:
        """The smallest step peak any plan reaches (bytes, exact for the plan found)."""
        return self.frontier[0].predicted_peak or 0

    @functools.cached_property
    def frontier(self) -> list[Plan]:
        """Every plan worth choosing, fastest last: the Pareto front of (exact simulated
        peak, time) over the plans the table holds. A level where the table's time improves
        holds a new plan; rounding makes neighbouring levels hold plans whose exact peaks
        interleave, so the front is filtered on the exact values."""
        c = self.costs
        top = self.table[(1, 0, c.n)]
        finite = np.isfinite(top)
        improves = finite & np.concatenate(([True], top[1:] < top[:-1]))
        found: dict[tuple[Item, ...], tuple[int, float]] = {}
        for lvl in np.flatnonzero(improves):
            items = self._build(1, 0, c.n, int(lvl))
            if items not in found:
                mem, time = need(items, c.n, True, c)
                found[items] = (step_peak(c, mem), time)
        if not found:  # costs no plan can meet (negative or inconsistent profiles)
            raise ConfigError(f"the profiled costs of these {c.n} blocks admit no plan; "
                              "check which blocks were chosen (blocks=)")
        front: list[Plan] = []
        for items, (peak, time) in sorted(found.items(), key=lambda kv: (kv[1][0], kv[1][1])):
            if front and time >= (front[-1].predicted_time or 0.0):
                continue  # no faster than a plan with a smaller (or equal) peak
            front.append(Plan(c.n, items, predicted_peak=peak, predicted_time=time))
        floor = front[0].predicted_peak
        return [replace(p, min_peak=floor) for p in front]

    def plan_for(self, budget: int, name: str = "optimal") -> Plan:
        """The fastest plan whose simulated step peak is at most `budget` bytes. Monotone by
        construction: a larger budget only adds plans to choose from."""
        fits = [p for p in self.frontier if (p.predicted_peak or 0) <= budget]
        if not fits:
            raise infeasible(budget, self.min_peak)
        return replace(fits[-1], name=name, budget=budget)

    def _build(self, h: int, s: int, t: int, level: int) -> tuple[Item, ...]:
        if s == t:
            return ()
        c = self.costs
        k = int(self.choice[(h, s, t)][level])
        if k < 0:
            held, _, _ = keep_terms(c, s, t, bool(h))
            return (s, *self._build(int(c.keeps_output[s]), s + 1, t,
                                    level - _units(held, self.unit)))
        held, _, recompute_base = checkpoint_terms(c, s, k, t, bool(h))
        rest = self._build(0, k, t, level - _units(held, self.unit))
        inner_level = min(self.levels, level - _units(recompute_base, self.unit))
        inner = self._build(1, s, k, inner_level)
        return (Segment(s, k, inner), *rest)


def _units(nbytes: float, unit: int) -> int:
    return math.ceil(nbytes / unit)


def _shift(arr: np.ndarray, by: int) -> np.ndarray:
    """out[m] = arr[m - by], +inf below 0, clamped to the top level above it."""
    idx = np.arange(arr.size) - by
    out = arr[np.clip(idx, 0, arr.size - 1)].copy()
    out[idx < 0] = _INF
    return out


def solve(costs: ChainCosts, levels: int = 2000, unit: int | None = None,
          allowed: Callable[[int, int], bool] | None = None) -> Solution:
    """Fill the DP tables up to the memory that keeping every activation needs.

    `allowed(start, end)` restricts which segments may be checkpointed (the per-layer
    problem of a model that runs its own layer loop); the recursion is otherwise the same, so
    the plan is optimal among the allowed ones.

    Each memory term is rounded up to a unit, at most 2n+2 times along a plan, so the grid
    gets that many levels of headroom above the full need: keeping everything stays feasible.
    """
    n = costs.n
    full, _ = need(tuple(range(n)), n, True, costs)
    unit = unit or max(1, math.ceil(full / levels))
    levels = math.ceil(full / unit) + 2 * n + 2
    size = levels + 1
    mem_levels = np.arange(size)
    table: dict[tuple[int, int, int], np.ndarray] = {}
    choice: dict[tuple[int, int, int], np.ndarray] = {}
    for s in range(n + 1):
        for h in (0, 1):
            table[(h, s, s)] = np.zeros(size)
    for length in range(1, n + 1):
        for s in range(n - length + 1):
            t = s + length
            for h in (0, 1):
                best, arg = _options(costs, s, t, h, table, mem_levels, unit, allowed)
                table[(h, s, t)] = best
                choice[(h, s, t)] = arg
    return Solution(costs, unit, levels, table, choice)


def _options(c: ChainCosts, s: int, t: int, h: int, table: dict, levels: np.ndarray,
             unit: int, allowed: Callable[[int, int], bool] | None
             ) -> tuple[np.ndarray, np.ndarray]:
    held, fwd, bwd = keep_terms(c, s, t, bool(h))
    best = _shift(table[(int(c.keeps_output[s]), s + 1, t)], _units(held, unit))
    best = best + c.fwd_time[s] + c.bwd_time[s]
    best[levels < _units(max(fwd, bwd), unit)] = _INF
    arg = np.full(levels.size, -1)
    for k in range(s + 1, t):
        if allowed is not None and not allowed(s, k):
            continue
        ck_held, ck_fwd, recompute_base = checkpoint_terms(c, s, k, t, bool(h))
        rest = _shift(table[(0, k, t)], _units(ck_held, unit))
        inner = _shift(table[(1, s, k)], _units(recompute_base, unit))
        cand = rest + inner + sum(c.fwd_time[s:k])
        cand[levels < _units(ck_fwd, unit)] = _INF
        better = cand < best
        best = np.where(better, cand, best)
        arg = np.where(better, k, arg)
    return best, arg
