"""Tables for people: a frame as Markdown (statistics, report, benchmarks), numbers written
by `rematlab.core.units.format_number`."""

from __future__ import annotations

import math

import pandas as pd

from rematlab.core.units import format_number


def markdown_table(df: pd.DataFrame, index: bool = False) -> str:
    """A frame as a Markdown table, numbers through `format_number` (with its index as the
    first column when `index`)."""
    if df.empty:
        return "(none)"
    if index:
        df = df.reset_index()
    cols = [str(c) for c in df.columns]
    rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in df.iterrows():
        rows.append("| " + " | ".join(format_number(v) for v in r) + " |")
    return "\n".join(rows)


def percent_columns(df: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """Fractions shown as percentages ('58.5 %'), the unit readers take such columns in."""
    out = df.copy()
    for c in columns:
        if c in out.columns:
            out[c] = [f"{100 * v:.1f} %" if isinstance(v, (int, float)) and math.isfinite(v)
                      else "" for v in out[c]]
    return out
