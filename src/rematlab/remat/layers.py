"""Real models checkpointed in place: the repeated layers, run by the model's own loop.

Hugging Face transformers, timm-style CNNs and most user models are not a chain rematlab can
run: their forward takes several inputs, builds masks and position tensors once and hands them
to every layer, and returns structured outputs. They all share one shape, though — a stack of
repeated layers (`transformer.h`, `encoder.layer`, `stages.*.blocks`). This module finds those
layers (or takes the ones the user names), and checkpoints a chosen layer by wrapping its own
`forward` with non-reentrant `torch.utils.checkpoint`, passing its real positional and keyword
arguments, as transformers' gradient checkpointing and torch's
`apply_activation_checkpointing` do. The model keeps its class, attributes, methods and
`state_dict` keys.

Which layers are checkpointed is decided per layer, not per segment of several layers: the
model's loop calls one layer at a time, so a region can only be one layer. The planner solves
that restricted problem optimally (`layers=True` in `solver.solve`) over a chain of pseudo-blocks:
block 0 is everything the model runs before its first layer (embeddings, masks), blocks
1..L the layers, block L+1 everything after the last one (head, loss), with the output alive
until backward. The layers' costs are profiled one by one on the arguments captured from a real
forward; the costs of the first and last pseudo-blocks are read from one tracked training step
of the whole model (`rematlab.remat.outer`).

.. warning::
   A layer runs its forward a second time during backward. Dropout masks are replayed and
   BatchNorm statistics are not updated twice (see `rematlab.remat.recompute`). Key/value caches are
   not passed to the layers during a training step under a plan (`use_cache=False`), as
   transformers does under gradient checkpointing: a recomputed layer would append to the
   cache again. Without gradients (evaluation, `generate`) layers run as they are.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from rematlab.core.batch import Batch, detached, first_float, tensors, to_device
from rematlab.core.steps import runs_on
from rematlab.exceptions import ConfigError
from rematlab.plans.offload import is_offload
from rematlab.plans.plan import OFFLOAD_INPUT, Plan, Selective, offload_cap
from rematlab.remat import compiled_budget
from rematlab.remat.offload import Offloader
from rematlab.remat.ops import run_option
from rematlab.remat.profiling import COMPILED_NOT_OFFLOADED
from rematlab.remat.recompute import RecomputeStats, recompute_contexts
from rematlab.remat.structure import check_fits

_ACTIVE: ContextVar[LayerRemat | None] = ContextVar("rematlab_layers", default=None)
# The runner of the planned forward running now, for layer frames torch.compile traces:
# dynamo cannot trace a ContextVar, and a compiled graph runs no Python, so a global set
# while the planned forward runs (eager or traced) suffices there. Eager layers read the
# ContextVar, which keeps threads apart.
_TRACED: LayerRemat | None = None
_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache")
_HOST = torch.device("cpu")


# --- the layers' real arguments ----------------------------------------------------------------


@dataclass
class LayerCall:
    """The arguments one layer received in a real forward, detached; `where` is the position
    (int) or keyword (str) of its hidden state, the tensor that flows from layer to layer."""

    args: tuple
    kwargs: dict
    where: int | str

    def hidden(self) -> torch.Tensor:
        return self.args[self.where] if isinstance(self.where, int) else self.kwargs[self.where]

    def with_hidden(self, x: torch.Tensor) -> tuple[tuple, dict]:
        if isinstance(self.where, int):
            args = list(self.args)
            args[self.where] = x
            return tuple(args), self.kwargs
        return self.args, {**self.kwargs, self.where: x}

    def others(self) -> list[torch.Tensor]:
        """Every other tensor argument (masks, position embeddings): they belong to the model
        around the layers, not to the layer's saved bytes."""
        keep = self.hidden()
        return [t for t in tensors((self.args, self.kwargs)) if t is not keep]


def capture(model: nn.Module, batch: Batch, layers: list[nn.Module]) -> list[LayerCall]:
    """Run one forward (no grad, state restored: `runs_on`, so a batch the model cannot take
    is said in one line, and the planner needs no forward of its own to check it) and
    record what each layer received; each layer must run exactly once, in the given
    order."""
    calls: list[tuple[int, LayerCall]] = []

    def hook(i: int) -> Callable:
        def pre(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            # kept on the host: every layer's input at once would crowd a GPU being planned
            args, kwargs = _without_cache(to_device(detached(args), _HOST),
                                          to_device(detached(kwargs), _HOST))
            calls.append((i, LayerCall(args, kwargs, _hidden_position(args, kwargs, i))))
        return pre

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True)
               for i, m in enumerate(layers)]
    try:
        runs_on(model, model, batch, type(model).__name__)
    finally:
        for h in handles:
            h.remove()
    order = [i for i, _ in calls]
    if order != list(range(len(layers))):
        raise ConfigError(f"the layers ran in the order {order[:12]}, not once each in model "
                          "order: rematlab plans layers that each run once per step")
    return [c for _, c in calls]


def _is_cache(value: Any) -> bool:
    """A key/value cache: transformers' `Cache`, or any class named like one. Common
    values are decided without walking the class hierarchy, which dynamo cannot trace."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return False
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is not None and isinstance(value, cache_utils.Cache):
        return True
    return any(c.__name__.endswith("Cache") for c in type(value).__mro__)


def _without_cache(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Arguments with key/value caches removed (a recomputed layer must not append to them)."""
    args = tuple(None if _is_cache(a) else a for a in args)
    kwargs = {k: (None if _is_cache(v) or (k in _CACHE_KWARGS and v is not None) else v)
              for k, v in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return args, kwargs


def _hidden_position(args: tuple, kwargs: dict, i: int) -> int | str:
    """Where a layer receives its hidden state: the first argument that is itself a floating
    tensor, by position or by keyword."""
    for where, value in [*enumerate(args), *kwargs.items()]:
        if isinstance(value, torch.Tensor) and first_float(value) is value:
            return where
    raise ConfigError(f"layer {i} receives no floating tensor to checkpoint")


def single_layer(start: int, end: int, n_blocks: int) -> bool:
    """Whether a segment [start, end) of the pseudo-block chain is one layer (what the
    model's own loop lets us checkpoint)."""
    return end == start + 1 and 0 < start < n_blocks - 1


# --- running the model under a per-layer plan ---------------------------------------------------


class LayerRemat:
    """A per-layer plan installed on a model's layers. The layers stay the user's modules;
    each gets a `forward` that checkpoints when a `LayerRemat` listing it is active, which is
    only inside the forward of the model returned by `apply` (see `attach`)."""

    def __init__(self, layers: list[nn.Module], plan: Plan) -> None:
        if plan.n_blocks != len(layers) + 2:
            raise ConfigError(f"plan is for {plan.n_blocks - 2} layers, the model has "
                              f"{len(layers)} (a per-layer plan has one block before and one "
                              "after the layers)")
        if not all(single_layer(s.start, s.end, plan.n_blocks) for s in plan.segments):
            raise ConfigError("a per-layer plan checkpoints single layers only "
                              f"(got {plan.describe()})")
        if any(isinstance(it, Selective) and not 0 < it.block < plan.n_blocks - 1
               for it in plan.items):
            raise ConfigError("op-level options apply to the model's layers only "
                              f"(got {plan.describe()})")
        check_fits(plan, layers, "layer", first=1)
        self.blocks = layers
        self.plan = plan
        self.recompute = RecomputeStats()
        # offloaded layers (`plans.offload`): their positions, and one offloader for all
        self.moved = {it.block - 1: (it.option, offload_cap(it.option)) for it in plan.items
                      if isinstance(it, Selective) and is_offload(it)}
        self.offloader = (Offloader([t for layer in layers
                                     for t in (*layer.parameters(), *layer.buffers())])
                          if self.moved else None)
        self.hooks: list[Callable[[torch.Tensor], None]] = []
        for layer in layers:
            _install(layer)

    def checkpoints(self, layer: nn.Module) -> bool:
        """Whether the plan checkpoints `layer`, whole or op by op (by identity: copies of a
        model have their own layers, and their own runner)."""
        return any(self.blocks[s.start - 1] is layer for s in self.plan.segments) or \
            self._option(layer) is not None or any(
                self.blocks[i] is layer and name == OFFLOAD_INPUT
                for i, (name, _) in self.moved.items())

    def _option(self, layer: nn.Module) -> Selective | None:
        return next((it for it in self.plan.items if isinstance(it, Selective)
                     and not is_offload(it) and self.blocks[it.block - 1] is layer), None)

    def offloading(self, layer: nn.Module, args: tuple, kwargs: dict,
                   forward: Callable[[], Any]) -> Any:
        """`forward()`, layer `layer`'s forward under this plan, with the offloader told
        (`remat.offload`): the layer's saved tensors moved if the plan offloads it, and its
        end of forward in any case (earlier layers' copies are waited for then)."""
        if self.offloader is None:
            return forward()
        if torch.compiler.is_compiling():
            raise ConfigError(COMPILED_NOT_OFFLOADED)
        index = next(i for i, b in enumerate(self.blocks) if b is layer)
        name, cap = self.moved.get(index, (None, None))
        kept = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if name == OFFLOAD_INPUT:  # checkpointed: the input it saves moves, the rest stays
            hidden = first_float((args, kwargs))
            kept = [t for t in kept if t is not hidden]
        with self.offloader.running(index, tuple(kept), cap, move=name is not None):
            return forward()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    def run(self, layer: nn.Module, args: tuple, kwargs: dict) -> Any:
        """`layer`'s own forward on `args`, checkpointed."""
        args, kwargs = _without_cache(args, kwargs)
        forward = functools.partial(type(layer).forward, layer)
        hidden = first_float((args, kwargs))
        for hook in self.hooks:
            if hidden is not None:
                hook(hidden)  # the layer's input stays alive for backward
        option = self._option(layer)
        if option is not None:
            return run_option(option, layer, forward, self.recompute,
                              f"layer {option.block - 1}", *args, **kwargs)
        if torch.compiler.is_compiling():  # dynamo rejects a custom context_fn
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False,
                          context_fn=recompute_contexts(self.recompute, [layer]), **kwargs)


class _LayerForward:
    """A layer's `forward` that consults the active plan; otherwise its class's forward.
    It reduces to itself around the layer, so that `copy.deepcopy` and pickling a model
    rebind it to the copied layer."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        signed(self, type(layer).forward.__get__(layer))

    def __reduce__(self) -> tuple:
        return (_LayerForward, (self.layer,))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        plan = _TRACED if torch.compiler.is_compiling() else _ACTIVE.get()
        # the class's forward is called with the layer, never bound to a local: dynamo, at a
        # graph break, rebuilds a bound method from the instance, whose `forward` is this
        # object, and would recurse forever
        layer = self.layer
        if plan is None or not torch.is_grad_enabled():
            return type(layer).forward(layer, *args, **kwargs)
        if plan.checkpoints(layer):
            return plan.offloading(layer, args, kwargs, lambda: plan.run(layer, args, kwargs))
        # a training step under a plan runs without key/value caches, kept layers too, as
        # transformers does under gradient checkpointing: a cache is for generation, and it
        # would hold every kept layer's keys and values until the output dies
        args, kwargs = _without_cache(args, kwargs)
        return plan.offloading(layer, args, kwargs,
                               lambda: type(layer).forward(layer, *args, **kwargs))


class _PlannedForward:
    """The forward of a model `attach` returns: the model's class forward with the plan
    active. Reduces to itself around the model and runner, as `_LayerForward` does."""

    def __init__(self, model: nn.Module, runner: LayerRemat) -> None:
        self.model = model
        self.runner = runner
        signed(self, type(model).forward.__get__(model))

    def __reduce__(self) -> tuple:
        return (_PlannedForward, (self.model, self.runner))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return compiled_budget.budgeted(self.runner.plan.fraction, self._run, *args, **kwargs)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        global _TRACED
        if not torch.compiler.is_compiling():
            refuse_double(self.model, self.runner.blocks)
        previous, _TRACED = _TRACED, self.runner
        try:
            if torch.compiler.is_compiling():
                return type(self.model).forward(self.model, *args, **kwargs)
            with self.runner.active():
                return type(self.model).forward(self.model, *args, **kwargs)
        finally:
            _TRACED = previous


def _install(layer: nn.Module) -> None:
    if not isinstance(layer.__dict__.get("forward"), _LayerForward):
        object.__setattr__(layer, "forward", _LayerForward(layer))


def rebound(value: Any, old: nn.Module, new: nn.Module) -> Any:
    """An attribute of `old` given to `new`, a copy of it made without `deepcopy`: the
    planned `forward` a layer got from rematlab is bound to `new` (the rest as it is)."""
    return _LayerForward(new) if isinstance(value, _LayerForward) and value.layer is old \
        else value


def is_plan(key: str, value: Any) -> bool:
    """Whether a module's attribute `key` is rematlab's plan on it (a planned model's
    `forward` and runner): a copy made to plan the model again leaves it out."""
    return key == "_rematlab" or isinstance(value, _PlannedForward)


def signed(wrapper: Any, original: Callable) -> Any:
    """`wrapper` given `original`'s name, docs and signature (`inspect.signature` reads
    `__signature__`): libraries read a model's `forward` to decide what to pass it (HF
    Trainer drops the dataset columns its signature does not name, PEFT and accelerate
    inspect it), so a planned model must show the same one."""
    wrapper.__signature__ = inspect.signature(original)
    wrapper.__name__ = getattr(original, "__name__", "forward")
    wrapper.__doc__ = getattr(original, "__doc__", None)
    return wrapper


def refuse_double(model: nn.Module, layers: list[nn.Module]) -> None:
    """A plan and transformers' own activation checkpointing on the same layers would
    checkpoint inside a checkpoint (every layer recomputed twice, the plan's budget void):
    refused, with what to do."""
    if any(getattr(m, "gradient_checkpointing", False) is True for m in (model, *layers)):
        raise ConfigError(f"{type(model).__name__} has transformers' activation checkpointing "
                          "on (gradient_checkpointing_enable(), or a trainer's "
                          "gradient_checkpointing=True); a rematlab plan replaces it: call "
                          "model.gradient_checkpointing_disable() (or leave the trainer's "
                          "gradient_checkpointing off)")


def attach(model: nn.Module, runner: Any) -> nn.Module:
    """A shallow copy of `model` (same class, same parameters, buffers, submodules and
    `state_dict` keys, and a `forward` with the same signature) whose forward runs under
    `runner`: a `LayerRemat` is activated around the model's own forward; a
    `strategies.RematChain` replaces it. `model` itself is left as it was. The runner is
    `remat_of(copy)`."""
    if isinstance(runner, LayerRemat):
        refuse_double(model, runner.blocks)
    twin = copy.copy(model)
    forward = _PlannedForward(twin, runner) if isinstance(runner, LayerRemat) \
        else signed(functools.partial(runner.forward), type(model).forward.__get__(model))
    object.__setattr__(twin, "forward", forward)
    object.__setattr__(twin, "_rematlab", runner)
    return twin


def offloader_of(model: nn.Module) -> Offloader | None:
    """The offloader of a model `rematlab.apply` returned with an offloading plan (None
    otherwise): a meter of its step is told which storages are host buffers through it."""
    return getattr(getattr(model, "_rematlab", None), "offloader", None)


def remat_of(model: nn.Module) -> Any:
    """The runner behind a model returned by `rematlab.apply` (its plan, recompute stats)."""
    runner = getattr(model, "_rematlab", None)
    if runner is None:
        raise ConfigError(f"{type(model).__name__} was not returned by rematlab.apply")
    return runner
