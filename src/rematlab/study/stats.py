"""Does remat change time and memory, do strategies differ, when is it worth it?

Paired design. A *block* is one (architecture, input, batch, dtype, device, optimizer) cell;
the treatment is the strategy; the response is the per-configuration median of step time and
of peak memory, analysed as log ratios to `none` in the same block (so a block's own scale
cancels). Tests come from scipy and statsmodels:

- Friedman across strategies within each architecture (blocks as rows);
- pairwise Wilcoxon signed-rank with `zero_method="zsplit"` (memory ties are common: two
  strategies often reach the same peak) and Holm correction;
- effect size: the Hodges–Lehmann estimate of the paired log ratio with a bootstrap CI,
  reported as "x% less memory [CI], y% more time [CI]";
- Kruskal–Wallis only for independent groups (devices / vendors);
- a mixed model `log(y) ~ strategy * architecture` with blocks as groups, for interactions;
- per-architecture claims, which rest on a handful of blocks (batch sizes), use a one-sample
  t-test on the best strategy's log ratios (see `_t_test_p`).

Repeat-level noise (coefficient of variation of the repeats) flags cells too noisy to
conclude from. The claims check states each of the original study's conclusions as a
hypothesis with its test and a verdict computed from the data — nothing is hard-coded.
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from scipy import stats as sps

from rematlab.exceptions import ConfigError
from rematlab.study.guidelines import (
    _claims,
    _guidelines,
)
from rematlab.study.inference import (
    BLOCK,
    MIN_BLOCKS,
    NOISY_CV,
    RESPONSES,
    Settings,
    hl_interval,
    hodges_lehmann,
    holm,
    signed_rank_p,
)
from rematlab.study.store import trusted_only
from rematlab.study.tables import markdown_table


@dataclass
class StatsReport:
    blocks: int
    friedman: pd.DataFrame
    pairwise: pd.DataFrame
    effects: pd.DataFrame
    kruskal: pd.DataFrame
    mixed: pd.DataFrame
    noise: pd.DataFrame
    guidelines: pd.DataFrame
    claims: pd.DataFrame
    notes: list[str] = field(default_factory=list)

    def tables(self) -> dict[str, pd.DataFrame]:
        return {"claims": self.claims, "guidelines": self.guidelines, "effects": self.effects,
                "friedman": self.friedman, "pairwise": self.pairwise, "kruskal": self.kruskal,
                "mixed model": self.mixed, "noisy cells": self.noise}

    def to_dict(self) -> dict:
        return {"blocks": self.blocks, "notes": self.notes,
                **{k: v.replace({np.nan: None}).to_dict(orient="records")
                   for k, v in self.tables().items()}}

    def to_markdown(self) -> str:
        parts = [f"Blocks analysed: {self.blocks}", *[f"- {n}" for n in self.notes]]
        for name, table in self.tables().items():
            parts += ["", f"### {name}", "", markdown_table(table)]
        return "\n".join(parts) + "\n"


def fp32_unless_said(frame: pd.DataFrame | None) -> pd.DataFrame | None:
    """`frame` with every configuration's precision said: fp32 where a row has none (rows
    from before the field, frames exported by an older rematlab), so blocks compare alike."""
    if frame is None:
        return None
    precision = frame.get("cfg_precision")
    return frame.assign(cfg_precision="fp32" if precision is None
                        else precision.fillna("fp32"))


def paired_log_ratios(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per (block, strategy != none): log ratios of time and memory to `none`."""
    ok = summary[summary["outcome"] == "ok"].copy()
    ok["block"] = ok[BLOCK].astype(str).agg("|".join, axis=1)
    base = ok[ok["cfg_strategy"] == "none"].set_index("block")
    rows = ok[(ok["cfg_strategy"] != "none") & ok["block"].isin(base.index)].copy()
    for name, col in RESPONSES.items():
        rows[f"log_{name}"] = np.log(rows[col].to_numpy(float)
                                     / base.loc[rows["block"], col].to_numpy(float))
    return rows


def analyze(summary: pd.DataFrame, runs: pd.DataFrame | None = None,
            settings: Settings | None = None,
            memory_cap: int | dict[str, int] | None = None,
            untrusted: bool = False) -> StatsReport:
    """All tests, effect sizes, guidelines and the claims check on a `config_summary` frame
    (and the `runs` frame for repeat-level noise). `memory_cap`: one cap, or one per
    architecture, for the 'enables batch under cap' guideline. Configurations whose timings
    the interference guard did not trust are left out (and counted in the notes) unless
    `untrusted`, or unless no trusted one is left: a busy machine's dataset is analysed with
    a note, not refused."""
    s = settings or Settings()
    summary, runs = (named_devices(fp32_unless_said(f)) for f in (summary, runs))
    notes = []
    if not untrusted:
        trusted, dropped = trusted_only(summary)
        if not (trusted["outcome"] == "ok").any() and dropped:
            notes.append(f"every ok configuration ({dropped}) was timed on a busy machine: "
                         "all are used, and every result here is untrusted")
        else:
            summary = trusted
            if dropped:
                notes.append(f"{dropped} configurations left out: the interference guard did "
                             "not trust their timings (see the trusted column)")
        if runs is not None:
            runs = runs[runs["config_id"].isin(summary["config_id"])]
    if not (summary["outcome"] == "ok").any():
        raise ConfigError("the dataset has no ok configuration to analyze")
    ratios = paired_log_ratios(summary)
    blocks = ratios["block"].nunique() if len(ratios) else 0
    if blocks < MIN_BLOCKS:
        notes.append(f"only {blocks} complete blocks (< {MIN_BLOCKS}): tests are inconclusive")
    effects = _effects(ratios, s)
    return StatsReport(
        blocks=blocks,
        friedman=_friedman(summary),
        pairwise=_pairwise(ratios, s),
        effects=effects,
        kruskal=_kruskal(ratios),
        mixed=_mixed(summary),
        noise=_noise(runs),
        guidelines=_guidelines(summary, ratios, s, memory_cap),
        claims=_claims_by_device(ratios, effects, s),
        notes=notes,
    )


def _effects(ratios: pd.DataFrame, s: Settings) -> pd.DataFrame:
    rows = []
    for (model, strategy), g in ratios.groupby(["cfg_model", "cfg_strategy"]):
        row = {"architecture": model, "strategy": strategy, "blocks": len(g)}
        for name in RESPONSES:
            x = g[f"log_{name}"].to_numpy()
            hl = hodges_lehmann(x)
            lo, hi = hl_interval(x, s)
            row.update({f"{name}_change": math.expm1(hl), f"{name}_ci_low": math.expm1(lo),
                        f"{name}_ci_high": math.expm1(hi), f"{name}_p": signed_rank_p(x)})
        row["summary"] = (f"{-row['memory_change']:.1%} less memory "
                          f"[{-row['memory_ci_high']:.1%}, {-row['memory_ci_low']:.1%}], "
                          f"{row['time_change']:+.1%} time "
                          f"[{row['time_ci_low']:+.1%}, {row['time_ci_high']:+.1%}]")
        rows.append(row)
    return pd.DataFrame(rows)


def _friedman(summary: pd.DataFrame) -> pd.DataFrame:
    ok = summary[summary["outcome"] == "ok"]
    rows = []
    for model, g in ok.groupby("cfg_model"):
        for name, col in RESPONSES.items():
            wide = g.pivot_table(index=BLOCK, columns="cfg_strategy", values=col).dropna()
            if wide.shape[1] < 3 or wide.shape[0] < 2:
                rows.append({"architecture": model, "response": name, "blocks": len(wide),
                             "strategies": wide.shape[1], "statistic": math.nan,
                             "p": math.nan})
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = sps.friedmanchisquare(*[wide[c].to_numpy() for c in wide.columns])
            rows.append({"architecture": model, "response": name, "blocks": len(wide),
                         "strategies": wide.shape[1], "statistic": float(res.statistic),
                         "p": float(res.pvalue) if np.isfinite(res.pvalue) else 1.0})
    return pd.DataFrame(rows)


def _pairwise(ratios: pd.DataFrame, s: Settings) -> pd.DataFrame:
    """Signed-rank tests between every pair of strategies (and each against none)."""
    rows = []
    if ratios.empty:
        return pd.DataFrame()
    for name in RESPONSES:
        wide = ratios.pivot_table(index="block", columns="cfg_strategy",
                                  values=f"log_{name}")
        wide.insert(0, "none", 0.0)
        for a, b in itertools.combinations(wide.columns, 2):
            d = (wide[b] - wide[a]).dropna().to_numpy()
            rows.append({"response": name, "a": a, "b": b, "blocks": len(d),
                         "hl_log_ratio": hodges_lehmann(d) if len(d) else math.nan,
                         "p": signed_rank_p(d)})
    out = pd.DataFrame(rows)
    for name in RESPONSES:
        mask = out["response"] == name
        out.loc[mask, "p_holm"] = holm(out.loc[mask, "p"])
    out["significant"] = out["p_holm"] < s.alpha
    return out


def named_devices(frame: pd.DataFrame | None) -> pd.DataFrame | None:
    """`frame` with a device name on every row (rows that recorded none: their vendor, or
    "unknown device"), the last of the blocks' factors (`inference.BLOCK`)."""
    if frame is None:
        return None
    named = frame.get("device_name", pd.Series(index=frame.index, dtype=object))
    vendor = frame.get("vendor", pd.Series(index=frame.index, dtype=object))
    return frame.assign(device_name=named.fillna(vendor).fillna("unknown device"))


def _claims_by_device(ratios: pd.DataFrame, effects: pd.DataFrame, s: Settings
                      ) -> pd.DataFrame:
    """The study's claims on each device apart (`device` names it): a conclusion that holds on
    a CPU need not hold on a GPU, nor on one vendor's GPU and another's (issue 51)."""
    if ratios.empty:
        return _claims(ratios, effects, s).assign(device="")
    devices = ratios["device_name"]  # named on every row (`named_devices`)
    if devices.nunique() == 1:
        return _claims(ratios, effects, s).assign(device=devices.iloc[0])
    return pd.concat([_claims(g, _effects(g, s), s).assign(device=name)
                      for name, g in ratios.groupby(devices)], ignore_index=True)


def _kruskal(ratios: pd.DataFrame) -> pd.DataFrame:
    """Devices are independent groups: Kruskal–Wallis on the log ratios per device."""
    if ratios.empty:
        return pd.DataFrame()
    groups = [g for _, g in ratios.groupby("device_name")]
    if len(groups) < 2:
        return pd.DataFrame([{"groups": len(groups), "response": n, "statistic": math.nan,
                              "p": math.nan, "note": "one device only"} for n in RESPONSES])
    rows = []
    for name in RESPONSES:
        res = sps.kruskal(*[g[f"log_{name}"].to_numpy() for g in groups])
        rows.append({"groups": len(groups), "response": name, "statistic": float(res.statistic),
                     "p": float(res.pvalue), "note": ""})
    return pd.DataFrame(rows)


def _mixed(summary: pd.DataFrame) -> pd.DataFrame:
    """`log(y) ~ strategy * architecture`, random intercept per block (statsmodels MixedLM)."""
    import statsmodels.formula.api as smf
    from patsy import PatsyError

    ok = summary[summary["outcome"] == "ok"].copy()
    if ok["cfg_model"].nunique() < 2 or ok["cfg_strategy"].nunique() < 2 or len(ok) < 12:
        return pd.DataFrame()
    ok["block"] = ok[BLOCK].astype(str).agg("|".join, axis=1)
    rows = []
    for name, col in RESPONSES.items():
        with np.errstate(divide="ignore", invalid="ignore"):
            ok["y"] = np.log(ok[col].astype(float))
        data = ok[np.isfinite(ok["y"])]  # a missing or zero figure cannot enter a log model
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fit = smf.mixedlm("y ~ C(cfg_strategy, Treatment('none')) * C(cfg_model)",
                                  data, groups=data["block"]).fit()
        except (ValueError, np.linalg.LinAlgError, PatsyError) as exc:
            rows.append({"response": name, "term": "(model not estimable)", "coef": math.nan,
                         "p": math.nan, "note": str(exc)[:80]})
            continue
        for term, coef in fit.params.items():
            if ":" in term:  # interactions: does the strategy effect depend on architecture?
                rows.append({"response": name, "term": term.replace(
                    "C(cfg_strategy, Treatment('none'))", "strategy").replace(
                    "C(cfg_model)", "arch"), "coef": float(coef),
                    "p": float(fit.pvalues.get(term, math.nan)), "note": ""})
    return pd.DataFrame(rows)


def _noise(runs: pd.DataFrame | None) -> pd.DataFrame:
    if runs is None or runs.empty:
        return pd.DataFrame()
    ok = runs[runs["outcome"] == "ok"]
    g = ok.groupby(["config_id", *BLOCK, "cfg_strategy"], dropna=False)["step_s"]
    cv = (g.std() / g.mean()).rename("cv").reset_index()
    cv["n"] = g.count().to_numpy()
    return cv[cv["cv"] > NOISY_CV].drop(columns="config_id").sort_values("cv",
                                                                           ascending=False)


