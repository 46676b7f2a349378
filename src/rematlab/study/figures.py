"""The study's figures, each a base64 PNG for the self-contained report: the Pareto fronts
with the planner's plans, ratios to no checkpointing against the batch size, the planner
against its budgets, predicted against measured, the gradient estimators, the largest
batches. What the interference guard did not trust is drawn hollow and named in the legend;
tick labels never run into each other (`_png` tidies every figure).
"""

from __future__ import annotations

import base64
import io
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import ScalarFormatter

from rematlab.study.store import trusted_mask

UNTRUSTED = "hollow: untrusted (timed on a busy machine)"


def _points(ax: plt.Axes, x: pd.Series, y: pd.Series, trusted: pd.Series, **style) -> None:
    """A scatter whose untrusted points are hollow (`UNTRUSTED`), in the same color."""
    color = style.pop("color")
    label = style.pop("label", None)
    ax.scatter(x[trusted], y[trusted], color=color, label=label, **style)
    if (~trusted).any():
        ax.scatter(x[~trusted], y[~trusted], facecolors="none", edgecolors=color, **style)


def _untrusted_legend(fig: plt.Figure, handles: list, labels: list) -> None:
    """The figure's legend, with an entry saying what a hollow point is."""
    handles = [*handles, plt.Line2D([], [], marker="o", ls="", markerfacecolor="none",
                                    markeredgecolor="gray")]
    fig.legend(handles, [*labels, UNTRUSTED], loc="upper center",
               ncol=min(8, len(labels) + 1), fontsize=8)


def _no_overlapping_ticks(fig: plt.Figure) -> None:
    """Hide tick labels that would overlap a neighbour (a log axis over less than a decade
    labels its minor ticks too, and a narrow panel runs them together): major labels are
    kept first, each dropped where it meets one already kept, then minor labels where they
    meet none. Point labels (a Pareto figure's batch sizes) likewise: each kept unless it
    meets one already kept."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        placed: list = []
        for text in ax.texts:
            box = text.get_window_extent(renderer)
            if any(box.overlaps(k) for k in placed):
                text.set_visible(False)
            else:
                placed.append(box)
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            kept: list = []
            for ticks in (axis.get_major_ticks(), axis.get_minor_ticks()):
                for tick in sorted(ticks, key=lambda t: t.get_loc()):
                    label = tick.label1
                    if not (label.get_visible() and label.get_text()
                            and lo <= tick.get_loc() <= hi):
                        continue
                    box = label.get_window_extent(renderer).expanded(1.05, 1.0)
                    if any(box.overlaps(k) for k in kept):
                        label.set_visible(False)
                    else:
                        kept.append(box)


def plain_axes(ax: plt.Axes) -> None:
    """Linear axes in plain numbers (no `1e-6+5.2461e1` offset where the values barely
    vary), and a degenerate range (one value, or a spread below 1 % of it) widened by 5 %
    either side, so that a flat line reads as what it is."""
    for axis, get, set_ in ((ax.xaxis, ax.get_xlim, ax.set_xlim),
                            (ax.yaxis, ax.get_ylim, ax.set_ylim)):
        if axis.get_scale() != "linear":
            continue
        formatter = ScalarFormatter(useOffset=False)
        formatter.set_scientific(False)
        axis.set_major_formatter(formatter)
        lo, hi = get()
        mid = (lo + hi) / 2
        if mid and hi - lo < 0.01 * abs(mid):
            set_(mid - 0.05 * abs(mid), mid + 0.05 * abs(mid))


def _png(fig: plt.Figure) -> str:
    for ax in fig.axes:
        plain_axes(ax)
    _no_overlapping_ticks(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def pareto_figure(summary: pd.DataFrame, plans: pd.DataFrame) -> str:
    """Peak memory against step time per architecture: every strategy and batch size, the
    planner's plans as stars; what the guard did not trust is hollow."""
    ok = summary[summary["outcome"] == "ok"]
    models = sorted(ok["cfg_model"].unique())
    cols = min(3, max(1, len(models)))
    rows = math.ceil(len(models) / cols) if models else 1
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    strategies = sorted(ok["cfg_strategy"].unique())
    colors = {s: plt.cm.tab10(i % 10) for i, s in enumerate(strategies)}
    for ax, model in zip(axes.flat, models, strict=False):
        g = ok[ok["cfg_model"] == model]
        for s, h in g.groupby("cfg_strategy"):
            _points(ax, h["step_s_median"] * 1e3, h["peak_bytes_median"] / 2**20, trusted_mask(h),
                    s=22, color=colors[s], label=s)
            for _, r in h.iterrows():
                ax.annotate(str(r["cfg_batch"]), (r["step_s_median"] * 1e3,
                                                  r["peak_bytes_median"] / 2**20),
                            fontsize=6, alpha=0.6)
        if not plans.empty:
            p = plans[(plans["model"] == model) & plans["step_s"].notna()]
            if len(p):
                _points(ax, p["step_s"] * 1e3, p["measured_peak"] / 2**20, trusted_mask(p),
                        marker="*", s=140, color="black", label="planner")
        ax.set_xscale("log")
        ax.set_title(model)
        ax.set_xlabel("step time (ms, median)")
        ax.set_ylabel("peak memory (MiB)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    _untrusted_legend(fig, handles, labels)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return _png(fig)


def ratio_figure(summary: pd.DataFrame) -> str | None:
    """Per architecture, peak memory and step time of each strategy as a ratio to `none` at
    the same batch size, against the batch size: where a strategy saves memory, and what it
    costs in time, as the batch grows. A ratio either of whose times the guard did not trust
    is a hollow point."""
    ok = summary[summary["outcome"] == "ok"].assign(trusted=lambda f: trusted_mask(f))
    cols = ["cfg_model", "cfg_batch", "cfg_strategy", "peak_bytes_median", "step_s_median",
            "trusted"]
    base = ok[ok["cfg_strategy"] == "none"][cols].rename(
        columns={"peak_bytes_median": "peak_none", "step_s_median": "time_none",
                 "trusted": "trusted_none"})
    other = ok[ok["cfg_strategy"] != "none"][cols].merge(
        base.drop(columns="cfg_strategy"), on=["cfg_model", "cfg_batch"])
    other["trusted"] = other["trusted"] & other["trusted_none"]
    if other.empty:
        return None
    models = sorted(other["cfg_model"].unique())
    fig, axes = plt.subplots(2, len(models), figsize=(3.3 * len(models), 6), squeeze=False)
    strategies = sorted(other["cfg_strategy"].unique())
    colors = {s: plt.cm.tab10(i % 10) for i, s in enumerate(strategies)}
    for j, model in enumerate(models):
        g = other[other["cfg_model"] == model]
        for s, h in g.groupby("cfg_strategy"):
            h = h.sort_values("cfg_batch")
            for i, ratio in enumerate((h["peak_bytes_median"] / h["peak_none"],
                                       h["step_s_median"] / h["time_none"])):
                axes[i, j].plot(h["cfg_batch"], ratio, color=colors[s], lw=1, label=s)
                _points(axes[i, j], h["cfg_batch"], ratio, h["trusted"], s=12,
                        color=colors[s])
        axes[0, j].set_title(model)
        for i, label in enumerate(("peak memory / none", "step time / none")):
            ax = axes[i, j]
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size")
            if j == 0:
                ax.set_ylabel(label)
            ax.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    _untrusted_legend(fig, handles, labels)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return _png(fig)


def planner_figure(plans: pd.DataFrame) -> str | None:
    """Per architecture, against the budget: the plan's measured step peak (it must stay
    under the diagonal), and its predicted time overhead beside that of the best uniform
    count that fits the same budget."""
    if plans.empty or "measured_peak" not in plans:
        return None
    models = list(dict.fromkeys(plans["model"]))
    fig, axes = plt.subplots(2, len(models), figsize=(3.3 * len(models), 6), squeeze=False)
    for j, model in enumerate(models):
        g = plans[plans["model"] == model].sort_values("budget")
        mib = g["budget"] / 2**20
        top, bottom = axes[0, j], axes[1, j]
        if g["budget"].nunique() == 1:  # one point: say so, rather than draw a bare dot
            top.text(0.5, 0.05, f"one feasible budget: {mib.iloc[0]:.1f} MiB",
                     transform=top.transAxes, ha="center", fontsize=7)
        top.plot(mib, g["measured_peak"] / 2**20, marker="o", label="plan, measured peak")
        top.plot(mib, mib, color="gray", lw=0.8, label="budget")
        top.set_title(model)
        bottom.plot(mib, 100 * g["predicted_overhead"], marker="o", label="plan")
        if "uniform_overhead" in g:
            fits = g[g["uniform_fits"].fillna(False).astype(bool)]
            bottom.plot(fits["budget"] / 2**20, 100 * fits["uniform_overhead"], marker="s",
                        linestyle="--", label="best uniform:N that fits")
        for ax in (top, bottom):
            ax.set_xlabel("budget (MiB)")
            ax.grid(alpha=0.3)
        if j == 0:
            top.set_ylabel("step peak (MiB)")
            bottom.set_ylabel("time overhead (%, simulated)")
            top.legend(fontsize=7)
            bottom.legend(fontsize=7)
    fig.tight_layout()
    return _png(fig)


def scatter_figure(predictions: pd.DataFrame) -> str:
    """Predicted against measured (out-of-fold) for time and memory, log-log."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, target in zip(axes, ("time", "memory"), strict=True):
        g = predictions[predictions["target"] == target]
        ax.scatter(g["measured"], g["predicted"], s=14, alpha=0.7)
        if len(g):
            lo = float(min(g["measured"].min(), g["predicted"].min()))
            hi = float(max(g["measured"].max(), g["predicted"].max()))
            ax.plot([lo, hi], [lo, hi], color="gray", lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        unit = "s" if target == "time" else "bytes"
        ax.set_xlabel(f"measured {target} ({unit})")
        ax.set_ylabel(f"predicted {target} ({unit})")
        ax.set_title(f"{target}: out-of-fold predictions")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def gradient_figures(gradients: dict) -> list[str]:
    """Accuracy against FLOPs and against time per model, mean over seeds per method."""
    runs = pd.DataFrame(gradients.get("runs", []))
    if runs.empty:
        return []
    models = sorted(runs["model"].unique())
    figs = []
    for xkey, label in (("flops", "FLOPs"), ("seconds", "wall time (s)")):
        fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
        for ax, model in zip(axes.flat, models, strict=True):
            for method, g in runs[runs["model"] == model].groupby("method", sort=False):
                length = min(len(a) for a in g["accuracy"])
                acc = np.mean([a[:length] for a in g["accuracy"]], axis=0)
                x = np.mean([v[:length] for v in g[xkey]], axis=0)
                keep = x > 0  # the untrained start has no place on a log axis
                ax.plot(x[keep], acc[keep], marker=".", label=method)
            ax.set_xscale("log")
            ax.set_xlabel(label)
            ax.set_ylabel("test accuracy")
            ax.set_title(model)
            ax.grid(alpha=0.3)
        axes.flat[0].legend(fontsize=7)
        fig.tight_layout()
        figs.append(_png(fig))
    return figs


def batch_figure(batches: pd.DataFrame) -> str:
    """Per architecture, at its cap: the largest batch without remat and with the optimal
    plan, and the throughput with remat relative to without, each at its largest batch
    (above 1: remat pays in samples per second)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    x = np.arange(len(batches))
    for offset, case, color in ((-0.2, "none", "tab:gray"), (0.2, "remat", "tab:blue")):
        left.bar(x + offset, batches[f"batch_{case}"], width=0.4, color=color,
                 label="no remat" if case == "none" else "optimal plan")
    left.set_yscale("log")
    left.set_title("largest batch under the cap")
    left.legend(fontsize=7)
    right.bar(x, batches["throughput_ratio"].fillna(0), width=0.5, color="tab:blue")
    right.axhline(1.0, color="gray", lw=0.8)
    right.set_title("samples/s with remat / without (each at its largest batch)")
    for ax in (left, right):
        ax.set_xticks(x, batches["model"])
    fig.tight_layout()
    return _png(fig)
