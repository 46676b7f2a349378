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
that restricted problem optimally (`allowed=` in `solver.solve`) over a chain of pseudo-blocks:
block 0 is everything the model runs before its first layer (embeddings, masks), blocks
1..L the layers, block L+1 everything after the last one (head, loss), with the output alive
until backward. The layers' costs are profiled one by one on the arguments captured from a real
forward; the costs of the first and last pseudo-blocks are read from one tracked training step
of the whole model (`outer_costs`).

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
import statistics
import sys
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rematlab.core.probes import LiveTensorTracker, clock_for
from rematlab.core.steps import (
    Batch,
    LossFn,
    batch_bytes,
    call,
    default_loss,
    detached,
    preserved,
    tensors,
    to_device,
)
from rematlab.exceptions import ConfigError
from rematlab.plans.plan import ChainCosts, Plan, none_plan
from rematlab.remat.chain import block_input, optimizer_memory, profile_block
from rematlab.remat.recompute import RecomputeStats, recompute_contexts

_ACTIVE: ContextVar[LayerRemat | None] = ContextVar("rematlab_layers", default=None)
# The runner of the planned forward running now, for layer frames torch.compile traces:
# dynamo cannot trace a ContextVar, and a compiled graph runs no Python, so a global set
# while the planned forward runs (eager or traced) suffices there. Eager layers read the
# ContextVar, which keeps threads apart.
_TRACED: LayerRemat | None = None
_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache")
_HOST = torch.device("cpu")


# --- finding the layers ----------------------------------------------------------------------


def find_layers(model: nn.Module, names: str | list[str] | None = None
                ) -> list[tuple[str, nn.Module]]:
    """The layers to checkpoint, as (qualified name, module) in model order.

    `names`: submodule names; a `ModuleList`/`Sequential` stands for its children (`"transformer.h"`
    -> every GPT-2 block). Without names: the most common way the ecosystem finds them — the
    class of module repeated (twice or more) inside a `ModuleList`/`Sequential` that holds the
    most parameters, and every module of that class not nested in another one.
    """
    modules = dict(model.named_modules())
    if names:
        found: list[tuple[str, nn.Module]] = []
        listed = [n.strip() for n in names.split(",")] if isinstance(names, str) else names
        for name in [n for n in listed if n]:
            if name not in modules:
                stacks = ", ".join(_stack_names(model)[:5]) or "none found"
                raise ConfigError(f"{type(model).__name__} has no submodule {name!r}; layer "
                                  f"stacks in it: {stacks}")
            m = modules[name]
            if isinstance(m, (nn.ModuleList, nn.Sequential)):
                found.extend((f"{name}.{k}", c) for k, c in m.named_children())
            else:
                found.append((name, m))
        if len(found) < 1:
            raise ConfigError(f"no layers under {names!r}")
        for i, (a, _) in enumerate(found):
            for b, _ in found[i + 1:]:
                if a == b or b.startswith(f"{a}.") or a.startswith(f"{b}."):
                    raise ConfigError(f"the layers named overlap: {a!r} and {b!r}; name each "
                                      "layer (or its stack) once")
        return found
    classes = {type(c) for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))
               for c in m.children() if not isinstance(c, (nn.ModuleList, nn.Sequential))
               and sum(type(o) is type(c) for o in m.children()) >= 2}
    if not classes:
        raise ConfigError(f"cannot find repeated layers in {type(model).__name__}: name them "
                          "with blocks=['path.to.layers'] (CLI: --blocks path.to.layers)")

    def size(cls: type) -> tuple[int, int]:
        layers = _outermost(model, cls)
        return sum(p.numel() for _, m in layers for p in m.parameters()), len(layers)

    return _outermost(model, max(classes, key=lambda c: (size(c), c.__name__)))


def _outermost(model: nn.Module, cls: type) -> list[tuple[str, nn.Module]]:
    out: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if type(m) is cls and not any(name.startswith(f"{o}.") for o, _ in out):
            out.append((name, m))
    return out


def _stack_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules()
            if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1 and n]


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
    """Run one forward (no grad, state restored) and record what each layer received; each
    layer must run exactly once, in the given order."""
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
        with torch.no_grad(), preserved(model):
            call(model, batch)
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
    for pos, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return pos
    for key, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return key
    raise ConfigError(f"layer {i} receives no floating tensor to checkpoint")


def _output_tensor(out: Any) -> torch.Tensor:
    for t in tensors(out):
        if t.is_floating_point():
            return t
    raise ConfigError(f"a layer returned no floating tensor ({type(out).__name__})")


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
        self.blocks = layers
        self.plan = plan
        self.recompute = RecomputeStats()
        self.hooks: list[Callable[[torch.Tensor], None]] = []
        for layer in layers:
            _install(layer)

    def checkpoints(self, layer: nn.Module) -> bool:
        """Whether the plan checkpoints `layer` (by identity: copies of a model have their
        own layers, and their own runner)."""
        return any(self.blocks[s.start - 1] is layer for s in self.plan.segments)

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
        hidden = next((t for t in tensors((args, kwargs)) if t.is_floating_point()), None)
        for hook in self.hooks:
            if hidden is not None:
                hook(hidden)  # the layer's input stays alive for backward
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
            return plan.run(layer, args, kwargs)
        # a training step under a plan runs without key/value caches, kept layers too, as
        # transformers does under gradient checkpointing: a cache is for generation, and it
        # would hold every kept layer's keys and values until the output dies
        args, kwargs = _without_cache(args, kwargs)
        return type(layer).forward(layer, *args, **kwargs)


class _PlannedForward:
    """The forward of a model `attach` returns: the model's class forward with the plan
    active. Reduces to itself around the model and runner, as `_LayerForward` does."""

    def __init__(self, model: nn.Module, runner: LayerRemat) -> None:
        self.model = model
        self.runner = runner

    def __reduce__(self) -> tuple:
        return (_PlannedForward, (self.model, self.runner))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        global _TRACED
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


def attach(model: nn.Module, runner: Any) -> nn.Module:
    """A shallow copy of `model` (same class, same parameters, buffers, submodules and
    `state_dict` keys) whose forward runs under `runner`: a `LayerRemat` is activated around
    the model's own forward; a `strategies.RematChain` replaces it. `model` itself is left as
    it was. The runner is `remat_of(copy)`."""
    twin = copy.copy(model)
    forward = _PlannedForward(twin, runner) if isinstance(runner, LayerRemat) \
        else runner.forward
    object.__setattr__(twin, "forward", forward)
    object.__setattr__(twin, "_rematlab", runner)
    return twin


def remat_of(model: nn.Module) -> Any:
    """The runner behind a model returned by `rematlab.apply` (its plan, recompute stats)."""
    runner = getattr(model, "_rematlab", None)
    if runner is None:
        raise ConfigError(f"{type(model).__name__} was not returned by rematlab.apply")
    return runner


# --- costs -------------------------------------------------------------------------------------


def profile_layers(model: nn.Module, batch: Batch, layers: list[nn.Module], *,
                   loss_fn: LossFn | None = None, optimizer: str | None = "momentum",
                   repeats: int = 1, compile: bool = False) -> ChainCosts:
    """Costs of the pseudo-block chain [before, layer 1..L, after] (see module docstring),
    measured on the batch's device; with `compile`, each layer's costs are those of the layer
    compiled (what the model around it does is measured eager, and the plan's compiled step
    is verified whole)."""
    calls = capture(model, batch, layers)
    rows = []
    device = next(tensors(batch)).device
    for layer, host_call in zip(layers, calls, strict=True):
        lc = LayerCall(to_device(host_call.args, device), to_device(host_call.kwargs, device),
                       host_call.where)
        x_in = block_input(lc.hidden(), needs_grad=True)

        def run(x: torch.Tensor, layer: nn.Module = layer, lc: LayerCall = lc) -> torch.Tensor:
            args, kwargs = lc.with_hidden(x)
            return _output_tensor(layer(*args, **kwargs))

        with preserved(layer):
            rows.append(profile_block(layer, x_in, repeats, run=run, others=lc.others(),
                                      compile=compile))
    outer = outer_costs(model, batch, layers, loss_fn, repeats)
    x = [0, *(r["x"] for r in rows), rows[-1]["out"].untyped_storage().nbytes(), 0]
    state, transient = optimizer_memory(list(model.parameters()), optimizer)
    params = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    inputs = batch_bytes(batch)
    # the step's time outside the layers: what no plan changes, so predicted times are steps
    outside = max(0.0, outer["step_time"] - sum(r["fwd_time"] + r["bwd_time"] for r in rows))

    # What a kept layer holds beyond its saved tensors (a key/value cache, hooks keeping
    # outputs): the live bytes each layer added in the real step, less what its profile
    # explains. A checkpointed layer holds none of it (caches are not passed to it).
    live = outer["layer_live"]
    for i, r in enumerate(rows):
        nxt = x[i + 2]
        explained = r["saved"] + nxt - (0 if r["keeps_input"] or i == 0 else r["x"])
        r["saved"] += max(0, live[i + 1] - live[i] - explained)

    def column(key: str, first: Any, last: Any) -> list:
        return [first, *(r[key] for r in rows), last]

    return ChainCosts(
        x=x,
        saved=column("saved", outer["before_saved"], outer["after_saved"]),
        keeps_input=column("keeps_input", False, outer["after_keeps_input"]),
        keeps_output=column("keeps_output", False, False),
        fwd_mem=column("fwd_mem", outer["before_fwd"], outer["after_fwd"]),
        bwd_mem=column("bwd_mem", outer["before_bwd"], outer["after_bwd"]),
        grad=column("grad", outer["before_grad"], outer["after_grad"]),
        fwd_time=column("fwd_time", 0.0, 0.0),
        bwd_time=column("bwd_time", outside, 0.0),
        fwd_flops=column("fwd_flops", 0.0, 0.0),
        base=params + state + inputs + outer["output"],
        state=state,
        optimizer_peak=params + grads + state + transient + inputs,
    )


def outer_costs(model: nn.Module, batch: Batch, layers: list[nn.Module],
                loss_fn: LossFn | None, repeats: int) -> dict:
    """Costs of what runs before the first layer and after the last, from one tracked
    training step with every layer kept: live bytes and peaks between five events — first
    layer entered, last layer left, loss computed, gradient of the last layer's output
    ready, gradient of the first layer's input ready (none when it needs no gradient, as
    under frozen embeddings: nothing before the layers runs backward) — and the step's
    end."""
    tracker = LiveTensorTracker()
    events: dict[str, tuple[int, int]] = {}
    seen: dict[str, Any] = {}

    def mark(name: str) -> None:
        events.setdefault(name, (tracker.live, tracker.peak))
        tracker.reset_peak()

    def on_grad(name: str) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            if name == "last_grad":
                seen["after_grad"] = [id(p) for p in model.parameters() if p.grad is not None]
            mark(name)
        return hook

    layer_live: list[int] = []  # live bytes as each layer starts, and after the last

    def entering(_m: nn.Module, args: tuple, kwargs: dict) -> None:
        layer_live.append(tracker.live)
        if len(layer_live) > 1:
            return
        x = _output_tensor((args, kwargs))
        seen["x_first"] = x.untyped_storage().nbytes()
        mark("first_in")
        if x.requires_grad:
            x.register_hook(on_grad("first_grad"))
        else:  # frozen embeddings (fine-tuning adapters): backward stops in the layers
            seen["frozen_input"] = True

    def last_out(_m: nn.Module, _args: tuple, out: Any) -> None:
        layer_live.append(tracker.live)
        y = _output_tensor(out)
        seen["y_last"] = y.untyped_storage().nbytes()
        seen["y_ref"] = weakref.ref(y.untyped_storage())
        mark("last_out")
        if y.requires_grad:
            y.register_hook(on_grad("last_grad"))

    handles = [m.register_forward_pre_hook(entering, with_kwargs=True) for m in layers]
    handles.append(layers[-1].register_forward_hook(last_out))
    params = list(model.parameters())
    plain = attach(model, LayerRemat(layers, none_plan(len(layers) + 2)))  # as planned runs
    try:
        with preserved(model):
            tracker.track([*params, *model.buffers(), *tensors(batch)])
            mark("start")
            with tracker:
                out = call(plain, batch)
                loss = (loss_fn or default_loss)(out, batch)
                mark("forward_end")
                alive = seen["y_ref"]() is not None
                output = batch_bytes(out)  # the user's loop keeps the output until the end
                loss.backward()
                mark("end")
            del out, loss
            step_time = _step_time(plain, batch, loss_fn, repeats)
    finally:
        for h in handles:
            h.remove()
    frozen = seen.get("frozen_input", False)
    need = {"first_in", "last_out", "forward_end", "last_grad", "end"} | (
        set() if frozen else {"first_grad"})
    if not need <= events.keys():
        raise ConfigError("the model's layers did not take part in backward as a chain "
                          f"(missing events: {sorted(need - events.keys())})")
    start, first_in_ = events["start"][0], events["first_in"]
    last_out_, fwd_end = events["last_out"], events["forward_end"]
    last_grad, end = events["last_grad"], events["end"]
    layer_params = {id(p) for m in layers for p in m.parameters()}
    outside = [p for p in params if id(p) not in layer_params and p.requires_grad]
    nbytes = {id(p): p.numel() * p.element_size() for p in outside}
    after_grad = sum(nbytes.get(i, 0) for i in seen.get("after_grad", []))
    y = seen["y_last"]
    return {
        "layer_live": layer_live,
        "output": output,
        "before_saved": first_in_[0] - start - seen["x_first"],
        "before_fwd": first_in_[1] - start,
        "before_bwd": 0 if frozen else end[1] - events["first_grad"][0],
        "before_grad": sum(nbytes.values()) - after_grad,
        "after_saved": fwd_end[0] - last_out_[0] + (0 if alive else y) - output,
        "after_keeps_input": alive,
        "after_fwd": fwd_end[1] - last_out_[0],
        "after_bwd": last_grad[1] - fwd_end[0],
        "after_grad": after_grad,
        "step_time": step_time,
    }


def _step_time(model: nn.Module, batch: Batch, loss_fn: LossFn | None, repeats: int) -> float:
    """Median seconds of a forward+backward step with every layer kept (after one warm-up)."""
    if repeats < 1:
        return 0.0
    clock = clock_for(next(tensors(batch)).device)
    times = []
    for _ in range(repeats + 1):
        clock.start()
        out = call(model, batch)
        (loss_fn or default_loss)(out, batch).backward()
        times.append(clock.stop())
        del out
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])
