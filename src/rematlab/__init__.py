"""rematlab: measure, model and optimize activation rematerialization in PyTorch training.

Public API: `apply` a strategy or plan, `measure` a configuration, `plan` the fastest
checkpointing for a memory budget, `prepare` (profile once, then `.choose(budget)` for any
budget, `.curve()` for all of them), `auto` (plan per input shape on the fly), `max_batch`
(the largest batch under a budget, with and without remat, and its throughput), `load` a
sweep's dataset, `predict` step time and peak memory. Pre-flight (`predict=True, target=...`
on `plan`, `prepare` and `max_batch`) plans without running, for a device that is not here
(`Target`, `PROFILES`), with `add_lora` for the way large models are fine-tuned. `Step`
describes the user's own training step (autocast, micro-batches, clipping, optimizer, and
its parallel layout: `FSDP` or `DDP`, planned per rank), for which every plan and measurement
is then made; `PlanOptions` says how to plan (its fields are also keywords of `plan`,
`prepare`, `max_batch` and `auto`). `rent` prices
every card x count for the user's step and work (which card to rent, with which plan).
`zoo` holds the study's six architectures.
"""

from rematlab.core.layout import DDP, FSDP
from rematlab.core.lora import add_lora
from rematlab.core.recipe import Step
from rematlab.exceptions import ConfigError, InfeasibleBudgetError, RematlabError
from rematlab.measurement import zoo
from rematlab.measurement.measure import measure
from rematlab.measurement.spec import Observation, Spec
from rematlab.planning.auto import auto
from rematlab.planning.maxbatch import max_batch
from rematlab.planning.options import PlanOptions
from rematlab.planning.planner import Planning, plan, prepare
from rematlab.planning.rent import RentResult, Work, rent
from rematlab.plans.plan import Plan
from rematlab.preflight.targets import PROFILES, Target
from rematlab.remat.strategies import apply, parse
from rematlab.version import __version__


def __getattr__(name: str):
    """The study's API loads its libraries on first use only: `predict` and `Predictor`
    scikit-learn, `load` DuckDB and pandas (planning needs none of them)."""
    if name in ("predict", "Predictor"):
        from rematlab.study import predictor as _predictor_module

        return getattr(_predictor_module, name)
    if name == "load":
        from rematlab.study.store import load

        return load
    raise AttributeError(f"module 'rematlab' has no attribute {name!r}")


__all__ = [
    "DDP",
    "FSDP",
    "PROFILES",
    "ConfigError",
    "InfeasibleBudgetError",
    "Observation",
    "Plan",
    "PlanOptions",
    "Planning",
    "Predictor",
    "RematlabError",
    "RentResult",
    "Spec",
    "Step",
    "Target",
    "Work",
    "__version__",
    "add_lora",
    "apply",
    "auto",
    "load",
    "max_batch",
    "measure",
    "parse",
    "plan",
    "predict",
    "prepare",
    "rent",
    "zoo",
]
