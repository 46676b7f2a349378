"""Module-level options: a block kept, its activation functions checkpointed.

Selective checkpointing (`rematlab.remat.ops`) decides op by op through a dispatch mode, which
costs host time on every op of the forward and of its recomputation (`benchmarks/
selective_overhead.py`: 24-28 µs per op on this CPU). Where what is worth recomputing is a
whole submodule, plain `torch.utils.checkpoint` around that module does the same with one
region and no dispatch mode (`recompute.recomputed_modules`): the activation functions,
whose pointwise ops save tensors the size of their input (issue 50).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rematlab.core.clocks import clock_for
from rematlab.core.steps import preserved


def activations(module: nn.Module) -> tuple[str, ...]:
    """The submodules of a block a module-level option recomputes: its activation
    functions, leaf modules without parameters that compute (dropout, identities and
    in-place activations excluded). A composite one (GPT-2's tanh GELU, eight pointwise
    ops) saves several tensors the size of its input, and holds only that input
    checkpointed."""
    skip = (nn.Dropout, nn.Identity)
    return tuple(name for name, m in module.named_modules()
                 if name and not list(m.children()) and not list(m.parameters(recurse=False))
                 and not list(m.buffers(recurse=False)) and not isinstance(m, skip)
                 and not getattr(m, "inplace", False))  # writes its input: nothing to keep


def short_module(name: str) -> str:
    """`mlp.act` -> `mlp.act`; a long path keeps its last two parts."""
    return ".".join(name.split(".")[-2:])


def submodule_seconds(module: nn.Module, names: tuple[str, ...],
                      run: Callable[[torch.Tensor], torch.Tensor], x_in: torch.Tensor,
                      repeats: int) -> float:
    """Median seconds the submodules `names` of `module` take in one forward of it (the
    device's clock around each, `core.clocks`): what a module-level option runs again in
    backward."""
    clock = clock_for(x_in.device)
    subs = [module.get_submodule(n) for n in names]
    runs: list[float] = []

    def start(*_: Any) -> None:
        clock.start()

    def stop(*_: Any) -> None:
        runs[-1] += clock.stop()

    handles = [h for m in subs for h in (m.register_forward_pre_hook(start),
                                         m.register_forward_hook(stop))]
    try:
        with preserved(module), torch.no_grad():
            for _ in range(repeats):
                runs.append(0.0)
                run(x_in)
    finally:
        for h in handles:
            h.remove()
    return statistics.median(runs)
