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
from statsmodels.stats.multitest import multipletests

from rematlab.exceptions import ConfigError
from rematlab.study.store import trusted_only
from rematlab.study.tables import markdown_table

BLOCK = ["cfg_model", "cfg_input", "cfg_batch", "cfg_dtype", "cfg_device", "cfg_optimizer"]
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


def hodges_lehmann(x: np.ndarray) -> float:
    """Median of the Walsh averages (x_i + x_j) / 2, i <= j: the estimate that goes with the
    signed-rank test."""
    x = np.asarray(x, dtype=float)
    i, j = np.triu_indices(len(x))
    return float(np.median((x[i] + x[j]) / 2.0))


def _hl_ci(x: np.ndarray, s: Settings) -> tuple[float, float]:
    if len(x) < 2 or np.all(x == x[0]):
        return float(x[0]) if len(x) else math.nan, float(x[0]) if len(x) else math.nan
    res = sps.bootstrap((x,), lambda a, axis: np.apply_along_axis(hodges_lehmann, axis, a),
                        n_resamples=s.bootstrap, method="percentile",
                        random_state=np.random.default_rng(s.seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def _signed_rank_p(x: np.ndarray) -> float:
    x = np.asarray(x, dtype=float)
    if len(x) == 0 or np.all(x == 0):
        return 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(sps.wilcoxon(x, zero_method="zsplit").pvalue)


def _t_test_p(x: np.ndarray) -> float:
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
        claims=_claims(ratios, effects, s),
        notes=notes,
    )


def _effects(ratios: pd.DataFrame, s: Settings) -> pd.DataFrame:
    rows = []
    for (model, strategy), g in ratios.groupby(["cfg_model", "cfg_strategy"]):
        row = {"architecture": model, "strategy": strategy, "blocks": len(g)}
        for name in RESPONSES:
            x = g[f"log_{name}"].to_numpy()
            hl = hodges_lehmann(x)
            lo, hi = _hl_ci(x, s)
            row.update({f"{name}_change": math.expm1(hl), f"{name}_ci_low": math.expm1(lo),
                        f"{name}_ci_high": math.expm1(hi), f"{name}_p": _signed_rank_p(x)})
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
                         "p": _signed_rank_p(d)})
    out = pd.DataFrame(rows)
    for name in RESPONSES:
        mask = out["response"] == name
        out.loc[mask, "p_holm"] = multipletests(out.loc[mask, "p"], method="holm")[1]
    out["significant"] = out["p_holm"] < s.alpha
    return out


def _kruskal(ratios: pd.DataFrame) -> pd.DataFrame:
    """Devices are independent groups: Kruskal–Wallis on the log ratios per vendor/device."""
    if ratios.empty:
        return pd.DataFrame()
    key = ratios["vendor"].fillna("") + ":" + ratios["device_name"].fillna("")
    groups = [g for _, g in ratios.groupby(key)]
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
            mlo, mhi = _hl_ci(h["log_memory"].to_numpy(), s)
            tlo, thi = _hl_ci(h["log_time"].to_numpy(), s)
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
        p = _signed_rank_p(x)
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
            lo, hi = _hl_ci(d, s) if len(d) else (math.nan, math.nan)
            within = bool(len(d)) and abs(lo) <= s.equivalence and abs(hi) <= s.equivalence
            p = _signed_rank_p(d)
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
    p = _t_test_p(per_block.to_numpy())
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
