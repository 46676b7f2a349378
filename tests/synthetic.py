"""Synthetic `config_summary` / `runs` frames with effects planted on purpose."""

from __future__ import annotations

import numpy as np
import pandas as pd

STRATEGIES = ["none", "uniform:2", "sqrt", "selective"]


def summary(effects: dict[str, tuple[float, float]], batches=(16, 32, 64, 128, 256, 512),
            strategies=STRATEGIES, noise: float = 0.01, seed: int = 0,
            selective_extra: float = 0.0) -> pd.DataFrame:
    """One row per configuration. `effects[model] = (memory ratio, time ratio)` applies to
    every remat strategy; `selective_extra` shifts selective's memory log ratio."""
    rng = np.random.default_rng(seed)
    rows = []
    for model, (mem, tim) in effects.items():
        for batch in batches:
            base_t = 0.01 * batch * rng.uniform(0.8, 1.2)
            base_m = 1e6 * batch * rng.uniform(0.8, 1.2)
            for strategy in strategies:
                remat = strategy != "none"
                m = base_m * (mem if remat else 1.0)
                if strategy.startswith("selective"):
                    m *= np.exp(selective_extra)
                t = base_t * (tim if remat else 1.0) * np.exp(rng.normal(0, noise))
                rows.append({"config_id": f"{model}-{batch}-{strategy}", "cfg_model": model,
                             "cfg_input": "x", "cfg_batch": batch, "cfg_dtype": "float32",
                             "cfg_device": "cpu", "cfg_optimizer": "momentum",
                             "cfg_strategy": strategy, "outcome": "ok", "step_s_median": t,
                             "peak_bytes_median": float(round(m)), "vendor": "CPU",
                             "device_name": "synthetic", "n": 3})
    return pd.DataFrame(rows)


def runs(frame: pd.DataFrame, cv: float = 0.02, repeats: int = 3, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for _, r in frame.iterrows():
        for k in range(repeats):
            rows.append({**r.to_dict(), "repeat": k,
                         "step_s": r["step_s_median"] * (1 + rng.normal(0, cv))})
    return pd.DataFrame(rows)
