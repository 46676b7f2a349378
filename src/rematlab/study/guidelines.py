"""Per-architecture guidelines and the study's claims, read off the paired log ratios and
effects that `rematlab.study.stats` computes: when remat pays off, which batch it enables,
and a verdict per claim with its test."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from rematlab.study.inference import (
    MIN_ARCH_BLOCKS,
    MIN_BLOCKS,
    RESPONSES,
    Settings,
    hl_interval,
    hodges_lehmann,
    signed_rank_p,
    t_test_p,
)


def _band(batch: int) -> str:
    return "small (<=32)" if batch <= 32 else "medium (33-128)" if batch <= 128 else "large (>128)"


def _guidelines(summary: pd.DataFrame, ratios: pd.DataFrame, s: Settings,
                memory_cap: int | dict[str, int] | None) -> pd.DataFrame:
    rows = []
    if ratios.empty:
        return pd.DataFrame()
    ratios = ratios.assign(band=ratios["cfg_batch"].map(_band))
    for (model, band), g in ratios.groupby(["cfg_model", "band"]):
        best = None
        for strategy, h in g.groupby("cfg_strategy"):
            mem = math.expm1(hodges_lehmann(h["log_memory"].to_numpy()))
            tim = math.expm1(hodges_lehmann(h["log_time"].to_numpy()))
            if tim <= s.max_overhead and -mem >= s.min_saving and (best is None or
                                                                    mem < best[1]):
                best = (strategy, mem, tim, h)
        row = {"architecture": model, "batch band": band, "blocks": g["block"].nunique()}
        if best is None:
            row.update({"recommended": "none", "memory saving": 0.0, "saving CI": "",
                        "time overhead": 0.0, "overhead CI": ""})
        else:
            strategy, mem, tim, h = best
            mlo, mhi = hl_interval(h["log_memory"].to_numpy(), s)
            tlo, thi = hl_interval(h["log_time"].to_numpy(), s)
            row.update({"recommended": strategy, "memory saving": -mem,
                        "saving CI": f"[{-math.expm1(mhi):.1%}, {-math.expm1(mlo):.1%}]",
                        "time overhead": tim,
                        "overhead CI": f"[{math.expm1(tlo):+.1%}, {math.expm1(thi):+.1%}]"})
        row["pays off from batch"] = _pays_off(ratios[ratios["cfg_model"] == model], s)
        cap = memory_cap.get(model) if isinstance(memory_cap, dict) else memory_cap
        row["enables batch under cap"] = _enables(summary[summary["cfg_model"] == model], cap)
        rows.append(row)
    return pd.DataFrame(rows)


def _pays_off(g: pd.DataFrame, s: Settings) -> int | None:
    """Smallest batch size at which some strategy saves at least `min_saving` of memory
    within `max_overhead` of time."""
    for batch, h in sorted(g.groupby("cfg_batch"), key=lambda kv: kv[0]):
        by = h.groupby("cfg_strategy")[["log_memory", "log_time"]].median()
        if ((np.expm1(by["log_memory"]) <= -s.min_saving)
                & (np.expm1(by["log_time"]) <= s.max_overhead)).any():
            return int(batch)
    return None


def _enables(g: pd.DataFrame, cap: int | None) -> int | None:
    """Smallest batch that `none` cannot fit under `cap` but some strategy can."""
    if cap is None:
        return None
    for batch, h in sorted(g.groupby("cfg_batch"), key=lambda kv: kv[0]):
        none = h[h["cfg_strategy"] == "none"]
        none_fits = ((none["outcome"] == "ok") & (none["peak_bytes_median"] <= cap)).any()
        other = h[(h["cfg_strategy"] != "none") & (h["outcome"] == "ok")]
        if not none_fits and (other["peak_bytes_median"] <= cap).any():
            return int(batch)
    return None


def _verdict(p: float, n: int, s: Settings, expect_difference: bool,
             within_margin: bool | None = None) -> str:
    if n < MIN_BLOCKS or not np.isfinite(p):
        return "inconclusive"
    if expect_difference:
        return "confirmed" if p < s.alpha else "not confirmed"
    if p < s.alpha:
        return "not confirmed"
    return "confirmed" if within_margin else "inconclusive"


def _claims(ratios: pd.DataFrame, effects: pd.DataFrame, s: Settings) -> pd.DataFrame:
    rows = []
    if ratios.empty:
        return pd.DataFrame([{"claim": "all", "test": "", "p": math.nan, "effect": "",
                              "verdict": "inconclusive"}])
    # (1) remat changes memory and time: per block, the median log ratio over strategies
    per_block = ratios.groupby("block")[["log_time", "log_memory"]].median()
    for name in RESPONSES:
        x = per_block[f"log_{name}"].to_numpy()
        p = signed_rank_p(x)
        rows.append({"claim": f"(1) remat changes {name} versus none",
                     "test": "Wilcoxon signed-rank (zsplit) of per-block median log ratio",
                     "blocks": len(x), "p": p,
                     "effect": f"{math.expm1(hodges_lehmann(x)):+.1%}",
                     "verdict": _verdict(p, len(x), s, expect_difference=True)})
    # (2) selective and uniform are indistinguishable
    strategies = set(ratios["cfg_strategy"])
    uniform = sorted(x for x in strategies if x.startswith("uniform"))
    selective = sorted(x for x in strategies if x.startswith("selective"))
    if uniform and selective:
        for name in RESPONSES:
            wide = ratios.pivot_table(index="block", columns="cfg_strategy",
                                      values=f"log_{name}")
            d = (wide[selective[0]] - wide[uniform[0]]).dropna().to_numpy()
            hl = hodges_lehmann(d) if len(d) else math.nan
            lo, hi = hl_interval(d, s) if len(d) else (math.nan, math.nan)
            within = bool(len(d)) and abs(lo) <= s.equivalence and abs(hi) <= s.equivalence
            p = signed_rank_p(d)
            rows.append({"claim": f"(2) {selective[0]} and {uniform[0]} do not differ in {name}",
                         "test": f"Wilcoxon signed-rank + HL CI within ±{s.equivalence:.0%}",
                         "blocks": len(d), "p": p, "effect": f"{math.expm1(hl):+.1%}",
                         "verdict": _verdict(p, len(d), s, False, within)})
    else:
        rows.append({"claim": "(2) selective and uniform do not differ", "test": "",
                     "blocks": 0, "p": math.nan, "effect": "", "verdict": "inconclusive"})
    # (3) per architecture
    expectations = {"mlp3": "none", "mlp5": "none", "mlp7": "none", "lenet5": "none",
                    "alexnet": "moderate", "vgg16": "reduction"}
    for model, expect in expectations.items():
        rows.append(_arch_claim(model, expect, ratios, effects, s))
    return pd.DataFrame(rows)


def _arch_claim(model: str, expect: str, ratios: pd.DataFrame, effects: pd.DataFrame,
                s: Settings) -> dict:
    text = {"none": "no memory benefit", "moderate": "moderate memory gains",
            "reduction": "memory reduction with bounded time overhead"}[expect]
    row = {"claim": f"(3) {model}: {text}", "test": "one-sample t-test of the best strategy's "
           "memory log ratios over blocks; effect HL with bootstrap CI",
           "blocks": 0, "p": math.nan, "effect": "", "verdict": "inconclusive"}
    e = effects[effects["architecture"] == model] if not effects.empty else effects
    if e.empty:
        return row
    best = e.loc[e["memory_change"].idxmin()]
    per_block = ratios[(ratios["cfg_model"] == model) & (ratios["cfg_strategy"]
                                                        == best["strategy"])]["log_memory"]
    p = t_test_p(per_block.to_numpy())
    n = len(per_block)
    significant = p < s.alpha and best["memory_ci_high"] < 0
    saving = -best["memory_change"]
    row.update({"blocks": n, "p": p, "effect": f"{best['strategy']}: {best['summary']}"})
    if n < MIN_ARCH_BLOCKS:
        return row
    benefit = significant and saving >= s.min_saving
    if expect == "none":
        row["verdict"] = "not confirmed" if benefit else "confirmed"
    elif expect == "moderate":
        row["verdict"] = "confirmed" if benefit and saving < 0.5 else "not confirmed"
    else:
        bounded = best["time_ci_high"] <= s.max_overhead
        row["verdict"] = "confirmed" if benefit and bounded else "not confirmed"
    return row
