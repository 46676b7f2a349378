"""The search behind the largest batch: costs interpolated between profiled batches, and
the bisections that find, then confirm by measurement, the largest batch that fits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

from rematlab.plans.plan import ChainCosts, Option


def scaled(low: ChainCosts, b_low: int, high: ChainCosts, b_high: int, batch: int
           ) -> ChainCosts:
    """The costs at `batch`, each interpolated (or extrapolated) affinely from the costs
    profiled at `b_low` and `b_high`; never below zero."""
    w = (batch - b_low) / (b_high - b_low)

    def at(a: Any, b: Any) -> Any:
        if isinstance(a, tuple) and all(isinstance(v, float) for v in a):  # a time interval
            return tuple(at(x, y) for x, y in zip(a, b, strict=True))
        if isinstance(a, (bool, str, tuple)):
            return b
        if isinstance(a, Option):
            return replace(b, **{f.name: at(getattr(a, f.name), getattr(b, f.name))
                                 for f in fields(Option)})
        if isinstance(a, list):
            return [at(x, y) for x, y in zip(a, b, strict=True)]
        value = max(0.0, a + (b - a) * w)
        return round(value) if isinstance(a, int) else value

    low, high = _common_menus(low, high), _common_menus(high, low)
    return ChainCosts(**{f.name: at(getattr(low, f.name), getattr(high, f.name))
                         for f in fields(ChainCosts)})


def _common_menus(costs: ChainCosts, other: ChainCosts) -> ChainCosts:
    """`costs` with each block's menu cut to the options `other` also has (by name): an
    option that pays at one batch size may not at another."""
    names = [{o.name for o in other.menu(i)} for i in range(other.n)]
    return replace(costs, options=[[o for o in costs.menu(i) if o.name in names[i]]
                                   for i in range(costs.n)] if costs.options else [])


def _bisect(fits: Callable[[int], bool], low: int, high: int) -> int:
    """The boundary between `low` (fits, or 0) and `high` (does not fit)."""
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low


def largest(fits: Callable[[int], bool], start: int, limit: int) -> int:
    """The largest `b <= limit` with `fits(b)`, assuming `fits` is monotone: doubling from
    `start`, then bisection. 0 when not even one sample fits."""
    start = max(1, min(start, limit))
    if fits(start):
        low, high = start, None
        while high is None:
            if low >= limit:
                return limit
            nxt = min(limit, 2 * low)
            if fits(nxt):
                low = nxt
            else:
                high = nxt
    else:
        low, high = 0, start
    return _bisect(fits, low, high)


def confirmed(fits: Callable[[int], bool], estimate: int, limit: int) -> int:
    """The batch `b` near `estimate` with `fits(b)` and not `fits(b + 1)` (or `b == limit`),
    galloping from the estimate in steps of 1, 2, 4... then bisecting: a few calls when the
    estimate is close."""
    b = max(1, min(estimate, limit))
    if fits(b):
        low, step, high = b, 1, None
        while high is None and low < limit:
            probe = min(limit, low + step)
            if fits(probe):
                low, step = probe, 2 * step
            else:
                high = probe
        if high is None:
            return limit
    else:
        high, step, low = b, 1, None
        while low is None:
            probe = max(0, high - step)
            if probe == 0 or fits(probe):
                low = probe
            else:
                high, step = probe, 2 * step
    return _bisect(fits, low, high)


