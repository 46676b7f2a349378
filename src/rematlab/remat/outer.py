"""What runs before a model's first layer and after its last, from one tracked training
step with every layer kept (`outer_costs`): the outer pseudo-blocks of the layer chain
[before, layer 1..L, after] (`rematlab.remat.layer_costs`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

import torch
from torch import nn

from rematlab.core.batch import Batch, batch_bytes, first_float, tensors
from rematlab.core.dispatch import OpRecorder
from rematlab.core.probes import LiveTensorTracker, rounded
from rematlab.core.recipe import Step
from rematlab.core.steps import preserved
from rematlab.core.timer import profile_timer, timed
from rematlab.exceptions import ConfigError
from rematlab.plans.fixed import none_plan
from rematlab.preflight.pricing import interval
from rematlab.preflight.roofline import LoggedOp, OpLog
from rematlab.preflight.targets import Target
from rematlab.remat.layers import LayerRemat, attach


def output_tensor(out: Any) -> torch.Tensor:
    """The floating tensor a layer hands on (its hidden state)."""
    t = first_float(out)
    if t is None:
        raise ConfigError(f"a layer returned no floating tensor ({type(out).__name__})")
    return t


class _Event(Enum):
    """The moments of one tracked step at which `outer_costs` reads the live bytes."""

    START = "start"
    FIRST_IN = "first layer entered"
    LAST_OUT = "last layer left"
    FORWARD_END = "loss computed"
    BACKWARD_START = "backward started"
    LAST_GRAD = "gradient of the last layer's output ready"
    FIRST_GRAD = "gradient of the first layer's input ready"
    END = "step ended"


@dataclass(frozen=True)
class _Mark:
    live: int  # bytes alive at the event
    peak: int  # the peak since the event before it


class _Probe:
    """Hooks on the first and the last layer that mark each `_Event` of one tracked step,
    and what they see on the way: the live bytes as each layer starts (and after the last),
    the first layer's input and the last one's output, and which parameters had their
    gradients when the last layer's output gradient arrived (those outside the layers after
    it: the head's)."""

    def __init__(self, model: nn.Module, tracker: LiveTensorTracker) -> None:
        self.model, self.tracker = model, tracker
        self.marks: dict[_Event, _Mark] = {}
        self.layer_live: list[int] = []
        self.x_first = self.y_last = 0
        self.y_ref: weakref.ref | None = None  # the last output's storage, while it lives
        self.frozen = False  # the first layer's input needs no gradient (frozen embeddings)
        self.grads_at_last: list[int] = []

    def mark(self, event: _Event) -> None:
        self.marks.setdefault(event, _Mark(self.tracker.live, self.tracker.peak))
        self.tracker.reset_peak()

    def _grad_hook(self, event: _Event) -> Callable:
        def hook(_grad: torch.Tensor) -> None:
            if event is _Event.LAST_GRAD:
                self.grads_at_last = [id(p) for p in self.model.parameters()
                                      if p.grad is not None]
            self.mark(event)
        return hook

    def _entering(self, _m: nn.Module, args: tuple, kwargs: dict) -> None:
        self.layer_live.append(self.tracker.live)
        if len(self.layer_live) > 1:
            return
        x = output_tensor((args, kwargs))
        self.x_first = x.untyped_storage().nbytes()
        self.mark(_Event.FIRST_IN)
        if x.requires_grad:
            x.register_hook(self._grad_hook(_Event.FIRST_GRAD))
        else:  # frozen embeddings (fine-tuning adapters): backward stops in the layers
            self.frozen = True

    def _leaving(self, _m: nn.Module, _args: tuple, out: Any) -> None:
        self.layer_live.append(self.tracker.live)
        y = output_tensor(out)
        self.y_last = y.untyped_storage().nbytes()
        self.y_ref = weakref.ref(y.untyped_storage())
        self.mark(_Event.LAST_OUT)
        if y.requires_grad:
            y.register_hook(self._grad_hook(_Event.LAST_GRAD))

    @contextlib.contextmanager
    def hooked(self, layers: list[nn.Module]) -> Iterator[None]:
        handles = [m.register_forward_pre_hook(self._entering, with_kwargs=True)
                   for m in layers]
        handles.append(layers[-1].register_forward_hook(self._leaving))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def check(self) -> None:
        """A `ConfigError` unless every event the chain model needs happened."""
        need = set(_Event) - ({_Event.FIRST_GRAD} if self.frozen else set())
        if not need <= self.marks.keys():
            missing = sorted(e.value for e in need - self.marks.keys())
            raise ConfigError("the model's layers did not take part in backward as a chain "
                              f"(missing events: {missing})")


@dataclass(frozen=True)
class _Ends:
    """What the tracked step left at its end: the output's bytes the loop keeps alive
    through backward (`Step.output_in_backward`), the loss's own bytes, and whether the last
    layer's output was still alive after forward."""

    output: int
    loss: int
    last_alive: bool


def _tracked_step(plain: nn.Module, batch: Batch, step: Step, probe: _Probe,
                  log: OpLog | None) -> _Ends:
    """One micro-batch of `step` through `plain` (every layer kept) under `log`, marking the
    events outside the layers' hooks."""
    tracker = probe.tracker
    probe.mark(_Event.START)
    with OpRecorder(tracker, *([log] if log is not None else [])):
        out, loss = step.forward(plain, batch)  # in the step's autocast region
        probe.mark(_Event.FORWARD_END)
        alive = probe.y_ref is not None and probe.y_ref() is not None
        loss_bytes = 0 if any(t is loss for t in tensors(out)) else rounded(
            loss.element_size() * loss.numel(), tracker.unit)  # the model's own?
        # a loop that keeps the output through backward (`Step.output_alive`)
        output = batch_bytes(out) if step.output_in_backward else 0
        if not step.output_in_backward:
            out = None  # dropped before backward: what autograd saved of it stays
        probe.mark(_Event.BACKWARD_START)
        loss.backward()
        probe.mark(_Event.END)
    return _Ends(output, loss_bytes, alive)


@dataclass
class OuterCost:
    """The costs of what runs before the first layer and after the last (`outer_costs`):
    the first and last pseudo-blocks of a layer chain (`remat.layer_costs`), bytes and
    seconds. `layer_live`: the live bytes as each layer is entered and after the last;
    `output`, `loss`: the model's output (where the loop holds it) and the loss, alive
    through backward; `before_*` / `after_*`: the pseudo-blocks' saved bytes, transient
    peaks and gradients, as `plans.plan.ChainCosts` names them; `step_time`: the step with
    every layer kept, and predicted, its (fastest, slowest) range."""

    layer_live: list[int]
    output: int
    loss: int
    before_saved: int
    before_fwd: int
    before_bwd: int
    before_grad: int
    after_saved: int
    after_keeps_input: bool
    after_fwd: int
    after_bwd: int
    after_grad: int
    step_time: float = 0.0
    step_range: tuple[float, float] | None = None
    ops: list[LoggedOp] | None = None  # predicted: the step's ops its time is priced from

    def priced(self, target: Target) -> OuterCost:
        """These predicted costs with the step's time priced on `target`."""
        assert self.ops is not None, "only a predicted step keeps its ops"
        fast, typical, slow = interval(self.ops, target)
        return replace(self, step_time=typical, step_range=(fast, slow))


def _outer_figures(probe: _Probe, ends: _Ends, params: list[torch.Tensor],
                   layers: list[nn.Module]) -> OuterCost:
    """The outer pseudo-blocks' costs from the marks (see `outer_costs`)."""
    at = probe.marks
    layer_params = {id(p) for m in layers for p in m.parameters()}
    nbytes = {id(p): p.numel() * p.element_size() for p in params
              if id(p) not in layer_params and p.requires_grad}
    after_grad = sum(nbytes.get(i, 0) for i in probe.grads_at_last)
    first_in, last_out = at[_Event.FIRST_IN], at[_Event.LAST_OUT]
    bwd_start, end = at[_Event.BACKWARD_START], at[_Event.END]
    return OuterCost(
        layer_live=probe.layer_live,
        output=ends.output,
        loss=ends.loss,
        before_saved=first_in.live - at[_Event.START].live - probe.x_first,
        before_fwd=first_in.peak - at[_Event.START].live,
        before_bwd=0 if probe.frozen else end.peak - at[_Event.FIRST_GRAD].live,
        before_grad=sum(nbytes.values()) - after_grad,
        after_saved=bwd_start.live - last_out.live
        + (0 if ends.last_alive else probe.y_last) - ends.output,
        after_keeps_input=ends.last_alive,
        after_fwd=at[_Event.FORWARD_END].peak - last_out.live,
        after_bwd=at[_Event.LAST_GRAD].peak - bwd_start.live,
        after_grad=after_grad,
    )


def outer_costs(model: nn.Module, batch: Batch, layers: list[nn.Module], step: Step,
                repeats: int, target: Target | None = None) -> OuterCost:
    """Costs of what runs before the first layer and after the last, from one tracked
    training step with every layer kept: live bytes and peaks between the step's events
    (`_Event`: first layer entered, last layer left, loss computed, gradient of the last
    layer's output ready, gradient of the first layer's input ready — none when it needs no
    gradient, as under frozen embeddings: nothing before the layers runs backward — and the
    step's end). With a `target`, the step's time is the roofline's of the ops it ran."""
    tracker = LiveTensorTracker(unit=target.unit if target is not None else 1)
    probe = _Probe(model, tracker)
    log = OpLog() if target is not None else None
    params = list(model.parameters())
    plain = attach(model, LayerRemat(layers, none_plan(len(layers) + 2)))  # as planned runs
    with preserved(model):
        tracker.track([*params, *model.buffers(), *tensors(batch)])
        with probe.hooked(layers):
            ends = _tracked_step(plain, batch, step, probe, log)
        seconds = step_time(plain, batch, step, repeats)
    probe.check()
    cost = _outer_figures(probe, ends, params, layers)
    cost.step_time = seconds
    if log is not None:
        cost.ops = log.ops
        return cost.priced(target)  # type: ignore[arg-type]
    return cost


def step_time(model: nn.Module, batch: Batch, step: Step, repeats: int) -> float:
    """Median seconds of one micro-batch's forward+backward with every layer kept, by the
    one timer (`rematlab.core.timer`, short repeats: a profile's figure, not a sweep's). No
    warm-up of its own: the tracked step just before it ran the same code on the same
    shapes."""
    if repeats < 1:
        return 0.0
    timer = profile_timer(next(tensors(batch)).device)
    work = timed(lambda: one_pass(model, model, batch, step))
    return timer.run(work, repeats, warmup=0).median()


def one_pass(owner: nn.Module, run: Callable, batch: Batch, step: Step) -> None:
    """`owner`'s gradients set to None, then one micro-batch of `step` through `run`: the
    step a profile times."""
    owner.zero_grad(set_to_none=True)
    step.micro_batch(run, batch)
