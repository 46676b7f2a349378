"""Spread and intervals, written once: the IQR every timing reports, and the percentile
bootstrap that the statistics and the gradient comparison put around their estimates."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np


def iqr(values: Sequence[float]) -> float:
    """Interquartile range (numpy's linear quantiles); NaN for fewer than two values."""
    if len(values) < 2:
        return math.nan
    q1, q3 = np.percentile(np.asarray(values, dtype=float), [25, 75])
    return float(q3 - q1)


def relative_spread(values: Sequence[float]) -> float:
    """IQR over median: how noisy a set of timings is (0 for fewer than two, or a median of
    0)."""
    if len(values) < 2:
        return 0.0
    median = float(np.median(values))
    return iqr(values) / median if median > 0 else 0.0


def bootstrap(samples: Sequence[Sequence[float]], statistic: Callable[..., float],
              resamples: int = 2000, seed: int = 0, vectorized: bool = False
              ) -> tuple[float, float]:
    """95 % percentile bootstrap interval of `statistic(*samples)`, each sample resampled
    within itself (scipy.stats.bootstrap). `vectorized`: the statistic takes `axis=` and
    reduces all resamples at once (much faster than one call per resample)."""
    from scipy import stats  # on first use: scipy is not part of `import rematlab`

    res = stats.bootstrap(tuple(np.asarray(s, dtype=float) for s in samples), statistic,
                          n_resamples=resamples, method="percentile", vectorized=vectorized,
                          random_state=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)
