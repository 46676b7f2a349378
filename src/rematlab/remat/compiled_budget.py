"""torch.compile's own activation memory budget as part of a compiled plan, and the settings a
compiled plan's peak was measured under.

Under `torch.compile` the min-cut partitioner decides what the backward recomputes; its
`activation_memory_budget` (a fraction: 0 recomputes everything it may, 1 is its runtime-
optimal choice) trades memory for time, but it is a fraction, not bytes: its peak is not
monotone in it (pytorch#197838) and can exceed its own limit (#197871). rematlab therefore
measures each fraction's compiled peak and treats the fraction as one more candidate of a plan
(`rematlab.planning.compiled`).

A plan's fraction is scoped to the planned model's forward (`budgeted`): the global
`torch._functorch.config.activation_memory_budget` is patched around it, in a frame dynamo
leaves to eager, so it holds while the frames below are compiled and partitioned. torch's own
scoped form, `torch.autograd.graph.region_activation_memory_budget`, must cover every op of a
graph: a graph break inside the model (transformers' loss function breaks GPT-2's) makes
dynamo run the region's frame eagerly, where the region does nothing — GPT-2 saved 13.95 MiB
under a region of 0 as under none, 3.2 MiB under the patch. A user's other compiled code keeps
the global budget. Checkpointed segments stay recompute regions inside the forward: the
fraction decides only for the kept blocks.

Dynamo keeps one compiled graph per code object and guards, and its guards on a model do not
tell apart copies that share every submodule (`rematlab.apply`'s, or the original): a graph
break inside the model makes the model's own forward the frame it caches, and a second copy
compiled under another budget in the same process reuses the first one's graph (on torch
2.11, measuring a chosen LeNet-5 plan again got another candidate's graph: 21.6 MB against the
19.5 MB measured while planning; 2.13 compiled it afresh). Compile one planned copy of a
model per process; rematlab measures each candidate after `torch._dynamo.reset()`
(`rematlab.planning.compiled`), and `rematlab.apply` of a compiled plan resets too
(`fresh_graphs`), so that no candidate measured while planning stands in for the plan.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

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


def fresh_graphs() -> None:
    """Drop the graphs dynamo keeps (module docstring): the next compile of the planned model
    partitions under the plan's own budget."""
    torch._dynamo.reset()


def budgeted(fraction: float | None, fn: Callable[..., Any], *args: Any, **kwargs: Any
             ) -> Any:
    """`fn(*args, **kwargs)` with torch.compile's activation memory budget at `fraction`
    (None: as it is) while dynamo compiles the frames it calls. This frame itself is left to
    eager (`torch.compiler.disable(recursive=False)`), so the patch is in force when the
    partitioner splits the forward graphs below it, a model's own graph breaks included;
    code compiled elsewhere keeps the global budget."""
    if fraction is None:
        return fn(*args, **kwargs)
    return _patched()(fraction, fn, *args, **kwargs)


@functools.cache
def _patched() -> Callable[..., Any]:
    """`budgeted`'s frame, made on first use: `torch.compiler.disable` imports dynamo,
    which planning an eager step never needs (`import rematlab` stays light)."""
    def patched(fraction: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with torch._functorch.config.patch(activation_memory_budget=fraction):
            return fn(*args, **kwargs)
    return torch.compiler.disable(patched, recursive=False)
