"""torch.compile's own activation memory budget as part of a compiled plan, and the settings a
compiled plan's peak was measured under.

Under `torch.compile` the min-cut partitioner decides what the backward recomputes; its
`activation_memory_budget` (a fraction: 0 recomputes everything it may, 1 is its runtime-
optimal choice) trades memory for time, but it is a fraction, not bytes: its peak is not
monotone in it (pytorch#197838) and can exceed its own limit (#197871). rematlab therefore
measures each fraction's compiled peak and treats the fraction as one more candidate of a plan
(`rematlab.planning.compiled`).

A plan's fraction is scoped to the planned model's forward with torch's
`torch.autograd.graph.region_activation_memory_budget` (a prototype in torch 2.13: one budget
per compiled graph, covering all of its forward ops), entered only while dynamo traces the
forward (the region raises in eager code), so a user's other compiled code keeps the global
`torch._functorch.config.activation_memory_budget`. Checkpointed segments stay recompute
regions inside it: the fraction decides only for the kept blocks.
"""

from __future__ import annotations

import contextlib

import torch

from rematlab.exceptions import ConfigError

MODE = "default"  # how rematlab compiles what it measures: torch.compile(fn, dynamic=False)


def global_fraction() -> float:
    """The partitioner's budget for graphs no region annotates."""
    return float(torch._functorch.config.activation_memory_budget)


def settings(fraction: float | None) -> dict:
    """What a compiled plan's peak was measured under: the torch version, the compile mode,
    and the activation memory budget its graph was partitioned with."""
    return {"torch": torch.__version__, "mode": MODE, "dynamic": False,
            "activation_memory_budget": global_fraction() if fraction is None else fraction}


def check(fraction: float | None, recorded: dict | None) -> None:
    """Refuse a compiled plan where its measured peak no longer holds: another torch, or
    (for a plan without a fraction of its own) another global memory budget."""
    if not recorded:
        return
    if recorded.get("torch") != torch.__version__:
        raise ConfigError(f"this compiled plan was measured under torch {recorded.get('torch')}"
                          f", this is {torch.__version__}: plan again")
    budget = global_fraction() if fraction is None else fraction
    if recorded.get("activation_memory_budget") != budget:
        raise ConfigError("this compiled plan was measured with torch.compile's "
                          f"activation_memory_budget {recorded.get('activation_memory_budget')}"
                          f", it would run under {budget}: plan again, or restore it")


def region(fraction: float | None) -> contextlib.AbstractContextManager:
    """The plan's budget around a forward dynamo is tracing; nothing otherwise."""
    if fraction is None or not torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch.autograd.graph.region_activation_memory_budget(fraction)
