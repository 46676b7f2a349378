"""Module-level options: a block kept, its activation functions checkpointed.

Selective checkpointing (`rematlab.remat.ops`) decides op by op through a dispatch mode, which
costs host time on every op of the forward and of its recomputation (`benchmarks/
selective_overhead.py`: 24-28 µs per op on this CPU). Where what is worth recomputing is a
whole submodule, plain `torch.utils.checkpoint` around that module does the same with one
region and no dispatch mode (`recomputed_modules`): the activation functions,
whose pointwise ops save tensors the size of their input (issue 50).
"""

from __future__ import annotations

import contextlib
import contextvars
import statistics
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rematlab.core.clocks import clock_for
from rematlab.core.dispatch import OpCall, Recorded
from rematlab.core.steps import preserved
from rematlab.exceptions import ConfigError
from rematlab.plans.plan import Selective
from rematlab.remat.policy import fingerprint, metadata
from rematlab.remat.recompute import RecomputeStats, recompute_contexts


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


def checked_modules(block: nn.Module, names: tuple[str, ...], where: str) -> tuple[str, ...]:
    """`names` if each is an activation function of `block` (`activations`: what a
    module-level option is made of), named once; a plan file edited to name another
    submodule, or made for another model, is refused with what the block has instead."""
    offered = activations(block)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"the plan names {', '.join(map(repr, twice))} twice in {where}'s "
                          "module-level option: it was edited; plan again")
    foreign = [n for n in names if n not in offered]
    if foreign:
        has = ", ".join(offered[:6]) + (" ..." if len(offered) > 6 else "") or "none"
        raise ConfigError(f"the plan recomputes {', '.join(map(repr, foreign))} in {where}, "
                          f"which is not among its activation modules ({has}): it was edited "
                          "or made for another model; plan again")
    return names


_checks: weakref.WeakKeyDictionary[nn.Module, set[Selective]] = weakref.WeakKeyDictionary()


def _checked(module: nn.Module) -> set[Selective]:
    """The module-level options whose op sequence `module` has been seen to run."""
    return _checks.setdefault(module, set())


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


# True while `torch.utils.checkpoint` itself runs around a recomputed submodule: the ops it
# dispatches of its own (torch 2.11 makes two `aten.empty` placeholders per region, 2.13
# none) are no part of the block's op sequence
_checkpoint_own = contextvars.ContextVar("_checkpoint_own", default=False)


class _OpNames(Recorded):
    """The names of the ops a forward runs, as `profile_ops` names them (metadata reads
    and the checkpoint's own ops left out): what a module-level option's `sequence`
    hashes."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def on_op(self, call: OpCall) -> None:
        if not metadata(call.func) and not _checkpoint_own.get():
            self.names.append(str(call.func))


@contextlib.contextmanager
def _own(value: bool) -> Iterator[None]:
    token = _checkpoint_own.set(value)
    try:
        yield
    finally:
        _checkpoint_own.reset(token)


def run_modules(item: Selective, module: nn.Module, fn: Callable, stats: RecomputeStats,
                where: str, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` — `module`'s forward — under the module-level option `item`:
    its submodules recomputed (`recomputed_modules`). The first forward with gradients is
    watched, once per module and option, and refused when its ops are not the sequence the
    option was made for (an edited plan, or another model: a ReLU GPT-2 under a GELU plan);
    later forwards run without a dispatch mode, which is what this kind of option is for."""
    with recomputed_modules(module, item.modules, stats):
        if not item.sequence or not torch.is_grad_enabled() or item in _checked(module):
            return fn(*args, **kwargs)
        # as `profile_ops` saw it: with saved-tensor hooks autograd saves an op's output
        # without the `aten.detach` it dispatches otherwise
        with torch.autograd.graph.saved_tensors_hooks(_same, _same), _OpNames() as seen:
            out = fn(*args, **kwargs)
    # the first forward under this option: no dispatch mode watches the later ones
    if fingerprint(seen.names) != item.sequence:
        raise ConfigError(f"the plan is stale: {where} ran {len(seen.names)} ops that do "
                          f"not match the op sequence its option ({item.option}) was made "
                          "for (the model or its input changed); plan again")
    _checked(module).add(item)
    return out


@contextlib.contextmanager
def recomputed_modules(block: nn.Module, names: tuple[str, ...], stats: RecomputeStats
                       ) -> Iterator[None]:
    """`block` run with its submodules `names` checkpointed: each keeps its input for
    backward and runs again there, through `recompute_contexts` (timed, BatchNorm frozen),
    instead of holding what its own ops save. How a module-level option runs: no dispatch
    mode sees each op, so the per-op host cost of selective checkpointing is not paid.
    The submodules' own `forward`s are put back when the block's forward returns."""
    subs = [block.get_submodule(name) for name in names]  # `checked_modules` when applied
    for sub in subs:
        inner, contexts = sub.forward, recompute_contexts(stats, [sub])

        def checkpointed(*args: Any, _inner: Callable = inner, _contexts: Callable = contexts,
                         **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)

            def module_own(*a: Any, **k: Any) -> Any:
                with _own(False):
                    return _inner(*a, **k)
            with _own(True):
                return checkpoint(module_own, *args, use_reentrant=False,
                                  context_fn=_contexts, **kwargs)
        object.__setattr__(sub, "forward", checkpointed)
    try:
        yield
    finally:
        for sub in subs:
            object.__delattr__(sub, "forward")
