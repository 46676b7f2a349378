"""rematlab's exceptions, all in one place and all subclasses of builtins.

Callers catch by type, never by matching message strings: an infeasible budget carries the
minimum feasible peak as an attribute. Sizes in messages are written by the raiser through
`rematlab.core.units` (`infeasible` makes this module's budget error), which imports this
module, never the reverse.
"""

from __future__ import annotations


class RematlabError(Exception):
    """Base class of every error rematlab raises on purpose."""


class ConfigError(RematlabError, ValueError):
    """Bad user input: unknown model, bad strategy string, malformed grid, negative batch..."""


class InfeasibleBudgetError(RematlabError, ValueError):
    """No plan fits the memory budget; `min_peak` is the smallest achievable step peak in bytes."""

    def __init__(self, budget: int, min_peak: int, message: str | None = None) -> None:
        self.budget = budget
        self.min_peak = min_peak
        super().__init__(message or f"budget {budget} bytes is infeasible: the smallest peak "
                                    f"for this model and batch is {min_peak} bytes")


class SimulatedOOM(RematlabError, MemoryError):
    """A step's tracked live bytes exceeded the `max_memory` cap that emulates a smaller device."""


class OutOfMemory(RematlabError, MemoryError):
    """The device ran out of memory where no result can stand for it: the floor plan's step
    itself, or the profile. A `MemoryError`, so that a search over batch sizes still reads it
    as "does not fit"."""


class StoreLockedError(RematlabError, OSError):
    """Another process is writing the same results database."""
