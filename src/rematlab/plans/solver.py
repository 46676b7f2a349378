"""Optimal checkpointing of a chain under a memory limit: a dynamic programme, no torch.

In the spirit of rotor (Beaumont et al., "Optimal checkpointing for heterogeneous chains",
2019): for every sub-chain [s, t), every memory level m and whether the sub-chain's input is
already held, the fastest schedule either runs block s keeping its activations and solves
[s+1, t), or checkpoints a segment [s, k) — keeping only its input — solves [k, t), and later
recomputes [s, k) under its own optimal (possibly again checkpointed) schedule. That recursion
is exactly `plan.need`, so the solver's plans and the simulator agree by construction. Under
autocast the forward also holds checkpointed blocks' cached weight casts
(`plan.cached_forward`), which the recursion does not see: the frontier's peaks are the
simulator's (`items_cost`), so no budget is broken, and the plans are optimal for the
recursion's costs, the casts added after.

Offload options (`rematlab.plans.offload`) are chosen like op-level options; the recursion
takes their reloads as prefetched, which the simulator corrects, so the chain is also solved
without them and the frontier is the Pareto front of both solutions' plans.

Why it is fast enough for long chains (docs/benchmarks/planner.md):
- **One table, every budget.** A solve fills the best time of the whole chain at every memory
  level; `Solution.frontier` reads the Pareto curve off it and a budget is a lookup.
- **Identical sub-chains are solved once.** Sub-chains are interned by the exact costs of
  their blocks: a chain of L identical layers between an embedding and a head has O(L)
  distinct sub-chains, not O(L²), so the DP does O(L²) work per level instead of O(L³).
- **The split point is vectorised.** All candidate segments [s, k) of one sub-chain are
  evaluated in one numpy gather over (k, level); with the input not yet held, every segment
  costs exactly the same plus the input, so that case is a shift of the held case.

Memory is discretised in `unit` bytes (`grid_unit`), with as many levels as about a second
of numpy allows (`affordable_levels`). The byte counts a plan adds up are rounded to the
nearest unit and transient peaks up; the unit divides the former whenever tensor sizes share a
factor that fine (they usually share a large power of two), and the DP is then exact at every
level. Otherwise rounding errors of both signs partly cancel: on random heterogeneous chains
(tests/test_solver.py; 25-50 blocks in docs/benchmarks/planner.md) the plan for budget B is
within 0.5 % of the time of the exact optimum for 0.995 B, and the floor within 0.5 % of the
exact floor. The frontier's peaks and times are the simulator's exact figures either way, so
a budget is never broken by rounding.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import numpy as np

from rematlab.core.units import infeasible
from rematlab.exceptions import ConfigError
from rematlab.plans.offload import without_offload
from rematlab.plans.plan import ChainCosts, Item, Plan, Segment, Selective, offloads
from rematlab.plans.simulate import items_cost, keep_terms, need

WORK = 100_000_000  # table cells a solve may read: about a second of numpy on this machine
MAX_CELLS = 20_000_000  # table cells (sub-chains x levels): ~240 MB with the choices
_INF = np.float32(np.inf)
_KEEP = -1  # choice code: run the block kept; -1 - j: under its option j (1-based); a
# checkpointed segment [s, k) is coded as k - s >= 1


@dataclass
class Solution:
    """DP tables for one chain: pick a plan for any memory level without solving again.

    `ids[s, t]` is the interned sub-chain [s, t); `table[h, id, m]` the fastest time of that
    sub-chain within m units (h: its input already held), `choice[h, id, m]` the decision;
    both with a leading mode (`_Grid`): the chain's top level, or inside a segment."""

    costs: ChainCosts
    unit: int
    levels: int
    ids: np.ndarray
    table: np.ndarray
    choice: np.ndarray
    # the chain solved without its offload options (`plans.offload`), whose plans the
    # frontier weighs too: the recursion takes reloads as prefetched, and where the
    # simulator says otherwise a plan without offload may be faster
    fallback: Solution | None = None

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
        top = self.table[-1, 1, self.ids[0, c.n]]
        finite = np.isfinite(top)
        improves = finite & np.concatenate(([True], top[1:] < top[:-1]))
        found: dict[tuple[Item, ...], tuple[int, float]] = {}
        for lvl in np.flatnonzero(improves):
            items = self._build(self.table.shape[0] - 1, 1, 0, c.n, int(lvl))
            if items not in found:
                found[items] = items_cost(items, c)
        if self.fallback is not None:
            for plan in self.fallback.frontier:
                found.setdefault(plan.items, items_cost(plan.items, c))
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

    def _build(self, mode: int, h: int, s: int, t: int, level: int) -> tuple[Item, ...]:
        """The items the table chose for [s, t) at `level` (`mode` 0: inside a checkpointed
        segment), replaying the DP's unit arithmetic (`_Grid`) so that every step lands on
        the level the DP read."""
        c, u = self.costs, self.unit
        items: list[Item] = []
        while s < t:
            code = int(self.choice[mode, h, self.ids[s, t], level])
            if code <= _KEEP:
                opt = c.menu(s)[_KEEP - code - 1] if code < _KEEP else None
                held, _, _ = keep_terms(c, s, t, bool(h), opt)
                items.append(Selective.of(s, opt) if opt else s)
                level -= _nearest(held, u)
                h, s = int(opt.keeps_output if opt else c.keeps_output[s]), s + 1
                continue
            k = s + code
            outer = 0 if h else _nearest(c.x[s], u)
            inner_level = min(self.levels, level - outer - _nearest(_inner_base(c, k, t), u))
            items.append(Segment(s, k, self._build(0, 1, s, k, inner_level)))
            level -= outer
            h, s = 0, k
        return tuple(items)


def _units(nbytes: float, unit: int) -> int:
    """A transient peak in units, rounded up: compared with a level once, exactly when the
    unit divides it (`m >= _units(b)` iff `m * unit >= b`)."""
    return math.ceil(nbytes / unit)


def _nearest(nbytes: int, unit: int) -> int:
    """A byte count the DP adds up, in units, rounded to the nearest: exact when the unit
    divides it; otherwise errors of both signs partly cancel along a plan, where rounding
    up would add n/2 units on average (the frontier's peaks are exact either way)."""
    return (int(nbytes) + unit // 2) // unit


def _inner_base(c: ChainCosts, k: int, t: int) -> int:
    """What is live when a segment ending at k is recomputed, beyond its input (see
    `checkpoint_terms`): the output gradient and the gradients of blocks k..t-1."""
    return c.x[k] - c.x[t] + c.grads_between(k, t)


def _summed_terms(c: ChainCosts) -> list[int]:
    """The byte counts the DP adds up along a plan: what kept blocks hold (saved tensors,
    boundaries) and the gradients live during a recomputation. Transient peaks are only
    compared with a level, once, so they need no common unit."""
    return [int(v) for v in (*c.x, *c.saved, *c.grad,
                             *(o.saved for i in range(c.n) for o in c.menu(i)))]


def grid_unit(c: ChainCosts, levels: int) -> int:
    """The memory unit for about `levels` levels up to the keep-everything need: a divisor
    of every summed term (`_summed_terms`) when one is that fine, so that only transients
    and gradients are rounded; else the need over `levels`, every term rounded up."""
    full, _ = need(tuple(range(c.n)), c.n, True, c)
    target = max(1, math.ceil(full / levels))
    common = functools.reduce(math.gcd, (abs(v) for v in _summed_terms(c)), 0)
    if common < target:
        return target
    first = math.ceil(common / target)
    return next((common // k for k in range(first, first + 4096) if common % k == 0), target)


def affordable_levels(lengths: np.ndarray, layers: bool) -> int:
    """How many memory levels a solve can afford: about `WORK` table cells read over all
    (sub-chain, split) pairs, within `MAX_CELLS` stored, between 1,024 and 16,384."""
    splits = int(np.count_nonzero(lengths)) if layers else int(np.maximum(lengths - 1, 0).sum())
    reads = splits + 2 * lengths.size  # the splits, and the two kept branches of each
    cap = MAX_CELLS // max(1, lengths.size)
    return int(min(max(WORK // max(1, reads), 1024), 16_384, cap))


def intern_subchains(c: ChainCosts, layers: bool) -> tuple[np.ndarray, np.ndarray]:
    """`ids[s, t]`: equal for two sub-chains whose blocks have equal costs, in order (the
    DP's value depends on nothing else), -1 below the diagonal; 0 is the empty chain. Also
    each id's length."""
    n = c.n
    kinds: dict[tuple, int] = {}
    kind = [kinds.setdefault((c.x[i], c.x[i + 1], c.saved[i], c.keeps_input[i],
                              c.keeps_output[i], c.fwd_mem[i], c.bwd_mem[i], c.grad[i],
                              c.rec_mem[i] if c.rec_mem else None, i == n - 1,
                              c.fwd_time[i], c.bwd_time[i], _alone(i, n, layers),
                              tuple(c.menu(i))), len(kinds))
            for i in range(n)]
    ids = np.full((n + 1, n + 1), -1, dtype=np.int64)
    known: dict[tuple[int, int], int] = {}
    lengths = [0]
    for s in range(n + 1):
        ids[s, s] = 0
        for t in range(s + 1, n + 1):
            key = (int(ids[s, t - 1]), kind[t - 1])
            if key not in known:
                known[key] = len(lengths)
                lengths.append(t - s)
            ids[s, t] = known[key]
    return ids, np.asarray(lengths)


def _alone(i: int, n: int, layers: bool) -> bool | None:
    """Whether block i may be checkpointed alone in a per-layer problem (None: any segment
    of a chain): a model's own loop runs layers 1..n-2, not what comes before or after."""
    return (0 < i < n - 1) if layers else None


def solve(costs: ChainCosts, levels: int | None = None, unit: int | None = None,
          layers: bool = False) -> Solution:
    """Fill the DP tables up to the memory that keeping every activation needs.

    `layers=True` solves the per-layer problem of a model that runs its own layer loop:
    segments are single blocks among 1..n-2 (its layers); the recursion is otherwise the
    same, so the plan is optimal among those.

    `levels` (default: what `affordable_levels` allows) sets the memory unit
    (`grid_unit`) unless `unit` is given. Each memory term is rounded up to a unit, at most
    2n+2 times along a plan, so the grid gets that many levels of headroom above the full
    need: keeping everything stays feasible.
    """
    offloading = any(offloads(o.name) for i in range(costs.n) for o in costs.menu(i))
    fallback = solve(without_offload(costs), levels, unit, layers) if offloading else None
    n = costs.n
    ids, lengths = intern_subchains(costs, layers)
    n_ids = lengths.size
    unit = unit or grid_unit(costs, levels or affordable_levels(lengths, layers))
    full, _ = need(tuple(range(n)), n, True, costs)
    top = math.ceil(full / unit) + 2 * n + 2
    grid = _Grid(costs, unit, top, n_ids, layers)
    done = np.zeros(n_ids, dtype=bool)
    done[0] = True
    for length in range(1, n + 1):
        for s in range(n - length + 1):
            sub = int(ids[s, s + length])
            if not done[sub]:
                grid.fill(s, s + length, ids)
                done[sub] = True
    return Solution(costs, unit, top, ids, grid.table, grid.choice, fallback)


class _Grid:
    """The DP tables and one sub-chain's update, `table[mode, h, id, level]`. Mode 1 is the
    chain's top level, where a kept block may run under an op-level option; mode 0 is inside
    a checkpointed segment, where it may not (a selective cache made in the segment's first
    forward would live until backward, beside the recomputation's); without menus the two
    are one table. Column `top + 1` of every row is +inf: a gather sends an infeasible level
    there instead of masking afterwards."""

    def __init__(self, c: ChainCosts, unit: int, top: int, n_ids: int, layers: bool) -> None:
        self.c, self.unit, self.top, self.layers = c, unit, top, layers
        self.width = top + 2
        modes = 2 if any(c.menu(i) for i in range(c.n)) else 1
        self.table = np.full((modes, 2, n_ids, self.width), _INF, dtype=np.float32)
        self.table[:, :, 0, : top + 1] = 0.0  # the empty chain costs nothing at any level
        self.choice = np.full((modes, 2, n_ids, self.width), _KEEP,
                              dtype=np.int16 if c.n < 2**15 else np.int32)
        self.m = np.arange(top + 1)
        self.prefix_fwd = np.concatenate(([0.0], np.cumsum(c.fwd_time)))

    def fill(self, s: int, t: int, ids: np.ndarray) -> None:
        for mode in range(self.table.shape[0]):
            self._fill(mode, s, t, ids)

    def _fill(self, mode: int, s: int, t: int, ids: np.ndarray) -> None:
        c, u, m = self.c, self.unit, self.m
        sub = ids[s, t]
        ck_time, ck_code = self._checkpoints(mode, s, t, ids)
        for h in (1, 0):
            best = np.full(m.size, _INF, dtype=np.float32)
            code = np.full(m.size, _KEEP, dtype=self.choice.dtype)
            for j, opt in enumerate([None, *(c.menu(s) if mode else [])]):
                held, fwd, bwd = keep_terms(c, s, t, bool(h), opt)
                ko, step = ((opt.keeps_output, opt.fwd_time + opt.bwd_time) if opt else
                            (c.keeps_output[s], c.fwd_time[s] + c.bwd_time[s]))
                cand = _shifted(self.table[mode, int(ko), ids[s + 1, t]], _nearest(held, u),
                                self.top) + np.float32(step)
                cand[m < _units(max(fwd, bwd), u)] = _INF
                better = cand < best
                best = np.where(better, cand, best)
                code = np.where(better, _KEEP - j, code)
            if ck_time is not None:
                by = 0 if h else _nearest(c.x[s], u)
                cand, cand_code = _shifted(ck_time, by, self.top), _shifted(ck_code, by,
                                                                            self.top)
                better = cand < best
                best = np.where(better, cand, best)
                code = np.where(better, cand_code, code)
            self.table[mode, h, sub, : self.top + 1] = best
            self.choice[mode, h, sub, : self.top + 1] = code

    def _checkpoints(self, mode: int, s: int, t: int, ids: np.ndarray
                     ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Best time over checkpointed segments [s, k), k < t, with the input held, at every
        level (the segment recomputed in mode 0, the rest in `mode`); and the chosen k - s.
        One gather over (k, level)."""
        c, u = self.c, self.unit
        ks = [s + 1] if self.layers else list(range(s + 1, t))
        if self.layers and not (0 < s < c.n - 1 and s + 1 < t):
            return None, None
        if not ks:
            return None, None
        karr = np.asarray(ks)
        inner_shift = np.array([_nearest(_inner_base(c, k, t), u) for k in ks])
        # peak of running [s, k) forward without saving, its input held (`checkpoint_terms`)
        run_peak = np.maximum.accumulate(
            [c.fwd_mem[i] + (c.x[i] if i > s else 0) for i in range(s, t - 1)])
        low = np.maximum(inner_shift, [_units(int(v), u) for v in run_peak[: len(ks)]])
        cols = np.minimum(self.m[None, :] - inner_shift[:, None], self.top)
        cols = np.where(self.m[None, :] >= low[:, None], cols, self.top + 1)
        inner_rows = self.table[0, 1].reshape(-1)
        inner = inner_rows[ids[s, karr][:, None] * self.width + cols]
        rest = self.table[mode, 0, ids[karr, t], : self.top + 1]
        fwd = (self.prefix_fwd[karr] - self.prefix_fwd[s] + c.checkpoint_cost(s)
               ).astype(np.float32)
        cand = inner + rest + fwd[:, None]
        arg = np.argmin(cand, axis=0)
        best = np.take_along_axis(cand, arg[None, :], axis=0)[0]
        return best, (karr[arg] - s).astype(self.choice.dtype)


def _shifted(arr: np.ndarray, by: int, top: int) -> np.ndarray:
    """out[m] = arr[m - by] for m in 0..top: +inf (or keep) below 0, the top level above."""
    idx = np.arange(top + 1) - by
    out = arr[np.clip(idx, 0, top)].copy()
    out[idx < 0] = _INF if out.dtype.kind == "f" else _KEEP
    return out

