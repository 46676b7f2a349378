"""rematlab: measure, model and optimize activation rematerialization in PyTorch training.

Public API: `apply` a strategy or plan, `measure` a configuration, `plan` the fastest
checkpointing for a memory budget, `auto` (plan per input shape on the fly), `load` a sweep's
dataset, `predict` step time and peak memory.
"""

__version__ = "0.1.0"

from rematlab.exceptions import ConfigError, InfeasibleBudgetError, RematlabError
from rematlab.measure import Observation, Spec, measure
from rematlab.plan import Plan
from rematlab.strategies import apply, parse

__all__ = [
    "ConfigError",
    "InfeasibleBudgetError",
    "Observation",
    "Plan",
    "RematlabError",
    "Spec",
    "apply",
    "measure",
    "parse",
]
