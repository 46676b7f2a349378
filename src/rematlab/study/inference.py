"""The statistical tests and estimates the study rests on, and their settings: the
Hodges-Lehmann estimate with its bootstrap interval, the signed-rank and t tests."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

from rematlab.core.spread import bootstrap

# a block: one configuration's factors but the strategy, on one physical device (two GPUs are
# both "cuda": their runs pair within a card, never across)
BLOCK = ["cfg_model", "cfg_input", "cfg_batch", "cfg_dtype", "cfg_device", "cfg_optimizer",
         "cfg_precision", "device_name"]

RESPONSES = {"time": "step_s_median", "memory": "peak_bytes_median"}
MIN_BLOCKS = 6  # below this a two-sided signed-rank test cannot reach p < 0.05
MIN_ARCH_BLOCKS = 3  # per-architecture claims: a t-test on log ratios works from 3 blocks
NOISY_CV = 0.10


@dataclass
class Settings:
    """Thresholds of the verdicts and guidelines (documented, overridable)."""

    alpha: float = 0.05
    equivalence: float = 0.05  # |log ratio| under which two strategies are "the same"
    min_saving: float = 0.05  # memory saving that counts as a benefit
    max_overhead: float = 0.30  # time overhead a recommendation may cost
    bootstrap: int = 2000
    seed: int = 0


def hodges_lehmann(x: np.ndarray, axis: int = -1) -> float | np.ndarray:
    """Median of the Walsh averages (x_i + x_j) / 2, i <= j: the estimate that goes with the
    signed-rank test; along `axis`, so that a bootstrap reduces all resamples at once."""
    x = np.moveaxis(np.asarray(x, dtype=float), axis, -1)
    i, j = np.triu_indices(x.shape[-1])
    out = np.median((x[..., i] + x[..., j]) / 2.0, axis=-1)
    return float(out) if out.ndim == 0 else out


def hl_interval(x: np.ndarray, s: Settings) -> tuple[float, float]:
    """The percentile bootstrap interval of the Hodges-Lehmann estimate (a point where the
    values do not vary)."""
    if len(x) < 2 or np.all(x == x[0]):
        return float(x[0]) if len(x) else math.nan, float(x[0]) if len(x) else math.nan
    return bootstrap((x,), hodges_lehmann, resamples=s.bootstrap, seed=s.seed,
                     vectorized=True)


def signed_rank_p(x: np.ndarray) -> float:
    """The two-sided signed-rank p-value, zeros split (`scipy.stats.wilcoxon`'s, the same
    number). With ties or zeros among at most 13 blocks scipy's `method="auto"` enumerates
    every sign flip through `permutation_test`, one statistic call per flip (a second for
    12 blocks); the same test is run here with the statistic vectorized over the flips."""
    x = np.asarray(x, dtype=float)
    if len(x) == 0 or np.all(x == 0):
        return 1.0
    ties = len(np.unique(np.abs(x))) < len(x) or bool(np.any(x == 0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if ties and len(x) <= _EXACT_FLIPS:
            return float(sps.permutation_test((x,), _rank_sum_plus, vectorized=True,
                                              permutation_type="samples",
                                              alternative="two-sided", axis=-1).pvalue)
        return float(sps.wilcoxon(x, zero_method="zsplit").pvalue)


_EXACT_FLIPS = 13  # scipy's bound: 2**13 flips are fewer than its 9,999 resamples


def _rank_sum_plus(d: np.ndarray, axis: int = -1) -> np.ndarray:
    """The signed-rank statistic of each row of `d`: the ranks of |d| where d > 0, half of
    those where d == 0 (`zero_method="zsplit"`)."""
    r = sps.rankdata(np.abs(d), axis=axis)
    return np.sum(r * (d > 0) + 0.5 * r * (d == 0), axis=axis)


def t_test_p(x: np.ndarray) -> float:
    """One-sample t-test of log ratios against 0. Per architecture there are few blocks (batch
    sizes), too few for a signed-rank test to ever reach 5 %; log ratios of peak memory are
    near-deterministic, which is where a t-test is at its best. Zero variance: p is 0 for a
    non-zero mean (an exact, repeatable effect) and 1 otherwise."""
    x = np.asarray(x, dtype=float)
    if len(x) < 2:
        return math.nan
    if np.allclose(x, x[0], rtol=0, atol=1e-12):
        return 0.0 if abs(x[0]) > 1e-12 else 1.0
    return float(sps.ttest_1samp(x, 0.0).pvalue)



def holm(p: np.ndarray) -> np.ndarray:
    """Holm's step-down adjusted p-values, exactly statsmodels' `multipletests(p,
    method="holm")[1]` (NaN kept last, tested equal), without the `gc.collect()` its holm
    branch runs on every call: 50-100 ms a call in a process that holds a model, which the
    study pays per response and device."""
    p = np.asarray(p, dtype=float)
    order = np.argsort(p)
    adjusted = np.minimum(1.0, np.maximum.accumulate(p[order] * np.arange(len(p), 0, -1)))
    out = np.empty_like(adjusted)
    out[order] = adjusted
    return out
