"""rematlab's exceptions, all in one place and all subclasses of builtins.

Callers catch by type, never by matching message strings: an infeasible budget carries the
minimum feasible peak as an attribute. `format_bytes` lives here because the messages need
it; parsing sizes from user input is `rematlab.core.units`.
"""

from __future__ import annotations


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
