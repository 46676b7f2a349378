"""The self-contained study report (HTML with embedded PNGs, and Markdown; the figures are
`rematlab.study.figures`).

The report is readable by someone who never ran rematlab: what was run and where, how each
figure was measured, the Pareto fronts with the planner's plans, predicted-versus-measured
scatters beside the original study's R², the statistics and guidelines, the gradient-estimator
comparison, and the limitations that follow from the data.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from jinja2 import Environment, PackageLoader, select_autoescape

from rematlab.core.files import write_bytes, write_text
from rematlab.core.units import format_number
from rematlab.study.figures import (
    batch_figure,
    gradient_figures,
    pareto_figure,
    planner_figure,
    ratio_figure,
    scatter_figure,
)
from rematlab.study.tables import percent_columns

STUDY_R2 = {"time": 0.8594, "memory": 0.8330}  # the original study, random 80/20 split


@dataclass
class StudyResults:
    """Everything the report shows; each part may be empty when its stage did not run."""

    grid: str
    summary: pd.DataFrame
    runs: pd.DataFrame
    evaluation: pd.DataFrame = field(default_factory=pd.DataFrame)
    predictions: pd.DataFrame = field(default_factory=pd.DataFrame)  # target, measured, pred
    predictor_models: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)  # StatsReport.to_dict()
    plans: pd.DataFrame = field(default_factory=pd.DataFrame)
    batches: pd.DataFrame = field(default_factory=pd.DataFrame)  # study._batch_stage rows
    gradients: dict = field(default_factory=dict)  # Comparison.to_dict()
    sweep: dict = field(default_factory=dict)
    about: str = ""  # what the grid is for (its `[study] about`), shown at the top


def limitations(res: StudyResults) -> list[str]:
    """What the data cannot say, derived from the data itself."""
    out = []
    vendors = set(res.summary.get("vendor", pd.Series(dtype=str)).dropna())
    if vendors <= {"CPU"}:
        out.append("All measurements ran on CPU: GPU allocators, kernels and the time cost of "
                   "recomputation differ; rerun the grid with device cuda for GPU guidance.")
    if len(vendors) < 2:
        out.append("One device only: device effects (Kruskal-Wallis, leave-one-device-out) "
                   "cannot be estimated.")
    n = res.summary.get("n")
    if n is not None and len(n) and int(n.max()) < 5:
        out.append(f"Few repeats per configuration (at most {int(n.max())}): time medians "
                   "carry noticeable noise.")
    blocks = res.stats.get("blocks", 0)
    if blocks and blocks < 12:
        out.append(f"Only {blocks} blocks (architecture x batch cells) enter the paired "
                   "tests: small effects can go undetected.")
    noisy = res.stats.get("noisy cells", [])
    if noisy:
        out.append(f"{len(noisy)} configurations have repeat CV above 10% and are flagged.")
    models = {r["model"] for r in res.gradients.get("table", [])} if res.gradients else set()
    if "bert-topics" in models:
        out.append("The gradient-estimator comparison fine-tunes a 2-layer, width-32 "
                   "BERT-style model pretrained in-process on synthetic topic documents "
                   "(LoRA rank 1): the paper's regime at a size a 2-core CPU trains in "
                   "minutes; the paper's models are 10^4 to 10^5 times larger.")
    if models - {"bert-topics"}:
        out.append("From-scratch rows train small zoo models on scikit-learn's digits, a "
                   "regime where FmAD and ZO barely leave chance.")
    return out


def _table(records: list[dict] | pd.DataFrame, columns: list[str] | None = None) -> dict:
    df = pd.DataFrame(records)
    if columns:
        df = df[[c for c in columns if c in df.columns]]
    rows = [[format_number(v, 4) for v in r] for r in df.itertuples(index=False)]
    return {"columns": list(df.columns), "rows": rows}


def _environment(res: StudyResults) -> dict:
    runs = res.runs
    if runs.empty:
        return {}
    first = runs.iloc[0]
    keys = ["device_name", "vendor", "cuda_version", "rocm_version", "torch_version",
            "cpu_model", "threads", "host", "rematlab_version"]
    env = {k: format_number(first.get(k), 4) for k in keys if k in runs.columns}
    if "device_name" in runs and runs["device_name"].nunique() > 1:  # each one measured
        env["device_name"] = ", ".join(sorted(runs["device_name"].dropna().unique()))
    env["measured from"] = str(runs["timestamp"].min()) if "timestamp" in runs else ""
    env["measured until"] = str(runs["timestamp"].max()) if "timestamp" in runs else ""
    return env


def _methods(res: StudyResults) -> dict:
    runs = res.runs
    cols = [c for c in runs.columns if c.startswith("method_")]
    return {c.removeprefix("method_"): str(runs[c].dropna().iloc[0]) for c in cols
            if runs[c].notna().any()}


def context(res: StudyResults) -> dict:
    """Everything the templates need, figures included (base64 PNG)."""
    ours = _our_r2(res)
    figures = _figures(res)
    counts = res.summary["outcome"].value_counts().to_dict() if len(res.summary) else {}
    return {
        "grid": res.grid,
        "about": res.about,
        "environment": _environment(res),
        "methods": _methods(res),
        "counts": counts,
        "configurations": len(res.summary),
        "sweep": res.sweep,
        "figures": figures,
        "evaluation": _table(percent_columns(res.evaluation, ["mape", "p90_ape"]))
        if not res.evaluation.empty else None,
        "r2": [{"target": t, "study": STUDY_R2[t], "ours": ours.get(t)} for t in STUDY_R2],
        "predictor_models": res.predictor_models,
        "claims": _table(res.stats.get("claims", []),
                         ["device", "claim", "test", "blocks", "p", "effect", "verdict"]),
        "guidelines": _table(percent_columns(pd.DataFrame(res.stats.get("guidelines", [])),
                                      ["memory saving", "time overhead"])),
        "effects": _table(res.stats.get("effects", []),
                          ["architecture", "strategy", "blocks", "summary", "memory_p",
                           "time_p"]),
        "friedman": _table(res.stats.get("friedman", [])),
        "plans": _table(res.plans) if not res.plans.empty else None,
        "batches": _table(res.batches) if not res.batches.empty else None,
        "gradients": _table(res.gradients.get("table", []),
                            ["model", "method", "seeds", "lr", "final_accuracy",
                             "accuracy_ci", "reached", "steps_to_target",
                             "seconds_to_target", "flops_to_target", "peak_bytes",
                             "cosine_to_true_grad", "diverged"])
        if res.gradients else None,
        "verdict": [(model, e["statement"]) for model, entries in
                    res.gradients.get("verdict", {}).items() for e in entries.values()]
        if res.gradients else [],
        "limitations": limitations(res),
        "stats_notes": res.stats.get("notes", []),
    }


def _our_r2(res: StudyResults) -> dict[str, float]:
    """The chosen predictor's best R² per target on the random 80/20 split, the study's
    protocol."""
    ours = {}
    if not res.evaluation.empty:
        ev = res.evaluation
        for target in ("time", "memory"):
            best = res.predictor_models.get(target)
            rows = ev[(ev["target"] == target) & (ev["protocol"] == "random 80/20")]
            if best is not None:
                rows = rows[rows["model"] == best]
            if len(rows):
                ours[target] = float(rows["r2"].max())
    return ours


def _figures(res: StudyResults) -> dict[str, str]:
    """The report's figures, each only where its data exists."""
    figures = {"pareto": pareto_figure(res.summary, res.plans)}
    ratios = ratio_figure(res.summary)
    if ratios is not None:
        figures["ratios"] = ratios
    planner = planner_figure(res.plans)
    if planner is not None:
        figures["planner"] = planner
    if not res.batches.empty:
        figures["batches"] = batch_figure(res.batches)
    if not res.predictions.empty:
        figures["scatter"] = scatter_figure(res.predictions)
    grad_figs = gradient_figures(res.gradients) if res.gradients else []
    if grad_figs:
        figures["accuracy_vs_flops"], figures["accuracy_vs_time"] = grad_figs
    return figures


def render(res: StudyResults, out_dir: str | Path) -> tuple[Path, Path]:
    """Write `report.html` (self-contained) and `report.md` (+ figures/*.png) into out_dir."""
    out = Path(out_dir)
    (out / "figures").mkdir(parents=True, exist_ok=True)
    ctx = context(res)
    for name, data in ctx["figures"].items():
        write_bytes(out / "figures" / f"{name}.png", base64.b64decode(data))
    env = Environment(loader=PackageLoader("rematlab", "templates"),
                      autoescape=select_autoescape(["html"]))
    html = out / "report.html"
    write_text(html, env.get_template("report.html.j2").render(**ctx))
    md = out / "report.md"
    write_text(md, env.get_template("report.md.j2").render(**ctx))
    return html, md
