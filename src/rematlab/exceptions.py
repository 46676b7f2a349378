"""rematlab's exceptions, all in one place and all subclasses of builtins.

Callers catch by type, never by matching message strings: an infeasible budget carries the
minimum feasible peak as an attribute.
"""

from __future__ import annotations

import math


class RematlabError(Exception):
    """Base class of every error rematlab raises on purpose."""


class ConfigError(RematlabError, ValueError):
    """Bad user input: unknown model, bad strategy string, malformed grid, negative batch..."""


class InfeasibleBudgetError(RematlabError, ValueError):
    """No plan fits the memory budget; `min_peak` is the smallest achievable step peak in bytes."""

    def __init__(self, budget: int, min_peak: int) -> None:
        self.budget = budget
        self.min_peak = min_peak
        super().__init__(
            f"budget {format_bytes(budget)} is infeasible: the smallest peak for this model "
            f"and batch is {format_bytes(min_peak)}"
        )


class SimulatedOOM(RematlabError, MemoryError):
    """A step's tracked live bytes exceeded the `max_memory` cap that emulates a smaller device."""


class StoreLockedError(RematlabError, OSError):
    """Another process is writing the same results database."""


def format_bytes(n: float) -> str:
    """Binary units with one decimal: 1.3 GiB, 509.0 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


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
