"""Reading and writing the numbers users give and read: byte sizes from text (`6GiB`,
`512MiB`, a number of bytes) and back (`1.3 GiB`), and numbers in tables (one formatter for
the CLI, the statistics markdown and the report). A budget is parsed here once, at the edge
(the CLI, `plan`, `max_batch`); everything past it holds bytes."""

from __future__ import annotations

import math

from rematlab.exceptions import ConfigError, InfeasibleBudgetError


def format_number(value: object, digits: int = 3) -> str:
    """A table cell: `digits` significant digits for floats, an interval (a pair of numbers)
    as `[lo, hi]`, blank for a missing value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return f"[{format_number(value[0], digits)}, {format_number(value[1], digits)}]"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(value: str | int | float) -> int:
    """'6GiB', '512MiB', '1.5GB' or a number of bytes -> int bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"memory size {value!r} is not a number of bytes")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or int(value) <= 0:
            raise ConfigError(f"memory size {value} must be a positive, finite number of bytes")
        return int(value)
    if not isinstance(value, str):
        raise ConfigError(f"memory size {value!r} is not a number with a unit")
    text = value.strip().lower().replace(" ", "")
    num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(num):]
    try:
        out = int(float(num) * _UNITS[unit])
    except (ValueError, KeyError, OverflowError):
        raise ConfigError(
            f"memory size {value!r} is not a number with a unit such as 512MiB or 6GiB"
        ) from None
    if out <= 0:
        raise ConfigError(f"memory size {value!r} must be positive")
    return out


def format_bytes(n: float) -> str:
    """Binary units with one decimal: 1.3 GiB, 509.0 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def infeasible(budget: int, min_peak: int) -> InfeasibleBudgetError:
    """The error of a budget below the smallest peak any plan reaches, sizes readable."""
    return InfeasibleBudgetError(budget, min_peak, f"budget {format_bytes(budget)} is "
                                 f"infeasible: the smallest peak for this model and batch "
                                 f"is {format_bytes(min_peak)}")
