"""The user's training step as data: `Step` says how the loop a plan is made for runs, and
every layer that prices a step (profiles, the simulator, verification, pre-flight, the study's
plan stage) reads it, so that a budget is for *that* step and not for rematlab's own.

What the trainers users run do, and what each field holds (Lightning's precision plugin and
HF's `TrainingArguments` describe the same loop):

- `precision`: the forward and the loss run under `torch.autocast` in bf16 or fp16 (HF
  `bf16=True`, Lightning `"bf16-mixed"`, Accelerate `mixed_precision="bf16"`); backward runs
  outside it. Autocast keeps a cache of the low-precision copies of trainable fp32 weights
  until the autocast region ends, so a checkpointed layer still holds its cast weights
  through the rest of the forward (`ChainCosts.cast`), and saved tensors have the dtypes
  autocast gives them. fp16 comes with a `torch.amp.GradScaler` (`scaler`), as every trainer
  pairs them: the loss is scaled, gradients are unscaled in place before clipping.
  Lightning's "bf16-true" / "16-true" / "64-true" mean no autocast and the weights (and the
  batch's floats) in that dtype: a plan is made on a copy so converted (`core.precision`).
- `micro_batches`: forwards per optimizer step (gradient accumulation). From the second
  micro-batch on, every parameter's gradient is alive through the forward and backward
  (`grads_resident`); a plan made for one micro-batch would overshoot.
- `clip`: `torch.nn.utils.clip_grad_norm_(params, clip)` before the optimizer step.
- `optimizer`: a name (`core.optimizers.OPTIMIZERS`) or a `torch.optim.Optimizer` class, with
  `optimizer_kwargs` (`lr`, `foreach`, `fused`, ...).
- `set_to_none`: `zero_grad(set_to_none=...)`; with False the gradients are alive (zeros)
  before the first forward, as under accumulation.
- `output_alive`: how long the loop holds the model's output. `True`: until the step ends
  (rematlab's own loop and most hand-written ones: `out = model(x)` lives until the next
  iteration, through the optimizer step). `False`: not to the step's end, which does not
  say whether before or after backward, so it is priced alive through its own backward and
  dropped before the optimizer step (`del out` after `loss.backward()`); reading it as
  "dropped before backward" put a floor plan 1.1 % over its budget in such a loop.
  `"forward"`: dropped before backward, as HF Trainer and Lightning do (`compute_loss` and
  `training_step` return the loss alone; the integrations say so); a language model's
  logits are then not part of the backward's peak. (A model run as a chain keeps counting
  its output, a classifier's scores: small, and on the safe side.)
- `loss_fn(output, batch)`, or the user's whole forward as `fn(model, batch) -> loss`, for
  anything else their step does (rematlab runs it under its probes).
- `layout`: how the step is spread over ranks, `FSDP(...)` or `DDP(...)`
  (`rematlab.core.layout`); a plan is then for one rank's step (`rematlab.distributed`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from rematlab.core.batch import Batch, tensors
from rematlab.core.checks import one_line, user_code
from rematlab.core.clocks import Clock
from rematlab.core.layout import DDP, FSDP, check_layout
from rematlab.core.optimizers import OPTIMIZERS, make_optimizer
from rematlab.core.precision import autocast_dtype, weights_dtype
from rematlab.core.steps import PHASES, LossFn, checked_loss, forward, is_oom
from rematlab.exceptions import ConfigError

StepFn = Callable[[nn.Module, Batch], torch.Tensor]  # fn(model, batch) -> loss


@dataclass(frozen=True)
class Step:
    """How the user's training step runs (module docstring). The default is rematlab's own
    step: fp32, one micro-batch, no clipping, momentum SGD, gradients set to None."""

    precision: str | torch.dtype | None = None
    micro_batches: int = 1
    clip: float | None = None
    optimizer: str | type[torch.optim.Optimizer] | None = "momentum"
    optimizer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    set_to_none: bool = True
    scaler: bool | None = None  # None: a GradScaler exactly when precision is fp16
    output_alive: bool | Literal["forward"] = True  # module docstring
    loss_fn: LossFn | None = None
    fn: StepFn | None = None
    layout: FSDP | DDP | None = None

    def __post_init__(self) -> None:
        self.autocast  # noqa: B018 - validates the precision
        check_layout(self.layout)
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) \
                or not 1 <= self.micro_batches <= 1_000_000:
            raise ConfigError(f"micro_batches must be an integer in [1, 1000000], got "
                              f"{self.micro_batches!r}")
        if self.clip is not None and not (isinstance(self.clip, (int, float))
                                          and 0 < self.clip < float("inf")):
            raise ConfigError(f"clip (the max gradient norm) must be a positive number, got "
                              f"{self.clip!r}")
        if not isinstance(self.set_to_none, bool):
            raise ConfigError(f"set_to_none must be True or False, got {self.set_to_none!r}")
        if not (isinstance(self.output_alive, bool) or self.output_alive == "forward"):
            raise ConfigError(f"output_alive must be True (until the step ends), False (until "
                              f"its backward has run) or 'forward' (dropped before backward), "
                              f"got {self.output_alive!r}"[:200])
        if self.scaler is not None and not isinstance(self.scaler, bool):
            raise ConfigError(f"scaler must be True, False or None (a GradScaler exactly with "
                              f"fp16), got {self.scaler!r}")
        if isinstance(self.clip, bool):
            raise ConfigError(f"clip is the max gradient norm (a positive number, or None for "
                              f"no clipping), got {self.clip!r}")
        opt = self.optimizer
        if isinstance(opt, str) and opt not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {opt!r}; choose one of "
                              f"{', '.join(OPTIMIZERS)} or pass a torch.optim.Optimizer class")
        if opt is not None and not isinstance(opt, str) and not (
                isinstance(opt, type) and issubclass(opt, torch.optim.Optimizer)):
            raise ConfigError(f"optimizer must be a name or a torch.optim.Optimizer class, "
                              f"got {opt!r}"[:200])
        if self.optimizer_kwargs and isinstance(opt, str):
            raise ConfigError("optimizer_kwargs go with an optimizer class (torch.optim.AdamW, "
                              "...), not a name")
        _check_optimizer(opt, self.optimizer_kwargs)
        if self.scaler and self.autocast != torch.float16:
            raise ConfigError("a GradScaler goes with fp16 autocast (precision='fp16')")
        for name in ("loss_fn", "fn"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ConfigError(f"{name} must be callable")
        if self.fn is not None and self.loss_fn is not None:
            raise ConfigError("give the loss once: a step function (fn) computes its own loss, "
                              "so it takes no loss_fn")

    @property
    def autocast(self) -> torch.dtype | None:
        """The autocast dtype, or None for a step without autocast."""
        return autocast_dtype(self.precision)

    @property
    def weights(self) -> torch.dtype | None:
        """The weights' dtype under a "-true" precision (`core.precision`), else None."""
        return weights_dtype(self.precision)

    @property
    def scaled(self) -> bool:
        """Whether the loss goes through a `torch.amp.GradScaler`."""
        return self.autocast == torch.float16 if self.scaler is None else self.scaler

    @property
    def output_in_backward(self) -> bool:
        """Whether the model's output is alive through its micro-batch's backward."""
        return self.output_alive != "forward"

    @property
    def output_to_end(self) -> bool:
        """Whether the last micro-batch's output is alive through the optimizer step."""
        return self.output_alive is True

    @property
    def grads_resident(self) -> bool:
        """Whether every parameter's gradient is alive from the start of a forward: under
        gradient accumulation (from the second micro-batch on), or when `zero_grad` sets
        them to zeros rather than None."""
        return self.micro_batches > 1 or not self.set_to_none

    def autocast_region(self, device: torch.device) -> contextlib.AbstractContextManager:
        """The autocast region a forward runs in (nothing for a full-precision step)."""
        dtype = self.autocast
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=dtype)

    def in_region(self, fn: Callable, device: torch.device) -> Callable:
        """`fn` run inside the step's autocast region (`fn` itself for full precision): how
        a block or layer is profiled, its backward left outside the region."""
        dtype = self.autocast
        if dtype is None:
            return fn

        def run(*args: Any, **kwargs: Any) -> Any:
            with self.autocast_region(device):
                return fn(*args, **kwargs)
        run.autocast_dtype = dtype  # what a profile's `CastRecorder` looks for
        return run

    def forward(self, model: Callable, batch: Batch) -> tuple[Any, torch.Tensor]:
        """The output (None for a step function) and the loss of one micro-batch, under the
        step's autocast region; backward runs outside it, as trainers run it."""
        device = _device_of(model, batch)
        with self.autocast_region(device):
            if self.fn is not None:
                with user_code("the step function fails", passes=is_oom):
                    loss = self.fn(model, batch)
                return None, checked_loss(loss, "the step function")
            return forward(model, batch, self.loss_fn)

    def backward_passes(self, run: Callable, batch: Batch, owner: nn.Module) -> None:
        """What a plan's measured peak covers of the step: every micro-batch's forward
        (under autocast) and backward (the loss scaled by a GradScaler's scale, divided by
        the micro-batches), then clipping. Gradients are set to zeros first when the loop
        keeps them (`set_to_none=False`); two micro-batches stand for any number above one,
        since from the second on each is the same (the gradients are alive). The optimizer
        step's peak is measured apart, on tensors shaped like the parameters
        (`optimizer_memory`), so the user's weights are never updated."""
        params = [p for p in owner.parameters() if p.requires_grad]
        if not self.set_to_none:
            for p in params:
                p.grad = torch.zeros_like(p)
        for _ in range(min(self.micro_batches, 2)):
            self.micro_batch(run, batch)
        if self.clip is not None and params:
            torch.nn.utils.clip_grad_norm_(params, self.clip)

    def micro_batch(self, run: Callable, batch: Batch) -> None:
        """One micro-batch's forward and backward (`for_backward`'s loss), the output alive
        through backward unless the loop drops it before (`output_alive="forward"`)."""
        out, loss = self.forward(run, batch)
        if not self.output_in_backward:
            out = None
        self.for_backward(loss).backward()
        del out, loss

    def for_backward(self, loss: torch.Tensor, scaler: torch.amp.GradScaler | None = None
                     ) -> torch.Tensor:
        """The loss backward starts from: divided by the micro-batches, then scaled by
        `scaler`, or by a GradScaler's initial scale (2^16) when the step has one and none
        is given (a profile's or a verification's step, which never updates a scale)."""
        if self.micro_batches > 1:
            loss = loss / self.micro_batches
        if scaler is not None:
            return scaler.scale(loss)
        if self.scaled:
            return loss * torch.full((), 2.0 ** 16, device=loss.device)
        return loss

    def train_step(self, model: nn.Module, batch: Batch, run: Callable | None = None,
                   optimizer: torch.optim.Optimizer | None = None,
                   clock: Clock | None = None,
                   around: Callable[[str], contextlib.AbstractContextManager] | None = None,
                   readable: bool = True) -> dict[str, float]:
        """The whole optimizer step of `run` (default: `model`) as the user's loop runs it,
        timed: gradients zeroed as the loop does, every micro-batch in the autocast region
        with its loss divided and scaled, backward, then unscaling, clipping and the
        optimizer's step (a GradScaler's update included), the last micro-batch's output
        alive as long as the loop holds it (`output_alive`). With `clock`, each phase's
        seconds (`steps.PHASES`) summed over the micro-batches, and the `step`'s;
        `around(phase)` wraps each phase in a context (a memory probe's phase marker);
        `readable=False` for fake tensors (`update`)."""
        run = run if run is not None else model
        times = dict.fromkeys(PHASES, 0.0)

        def timed(name: str, work: Callable[[], Any]) -> Any:
            if clock is not None:
                clock.start()
            with around(name) if around else contextlib.nullcontext():
                result = work()
            if clock is not None:
                times[name] += clock.stop()
            return result

        scaler = (self.make_scaler(_device_of(model, batch)) if optimizer is not None
                  else None)
        (optimizer or model).zero_grad(set_to_none=self.set_to_none)
        out = None
        for _ in range(self.micro_batches):
            del out  # the previous micro-batch's output, before the next forward
            out, loss = timed("forward", lambda: self.forward(run, batch))
            if not self.output_in_backward:
                out = None
            timed("backward", self.for_backward(loss, scaler).backward)
            del loss
            if not self.output_to_end:
                out = None
        if optimizer is not None:
            timed("optimizer", lambda: self.update(model.parameters(), optimizer, scaler,
                                                   readable))
        del out
        times["step"] = sum(times[p] for p in PHASES)
        return times

    def update(self, params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer,
               scaler: torch.amp.GradScaler | None, readable: bool = True) -> None:
        """The optimizer phase: unscale, clip, step (through the scaler), update the scale.
        A scaler's step reads whether a gradient overflowed (`.item()`), which fake and meta
        tensors cannot answer: with `readable=False` the update runs unconditionally, as it
        does when none did."""
        params = list(params)
        if scaler is not None:
            scaler.unscale_(optimizer)
        if self.clip is not None and params:
            torch.nn.utils.clip_grad_norm_(params, self.clip)
        if scaler is not None and readable:
            scaler.step(optimizer)
        else:
            optimizer.step()
        if scaler is not None:
            scaler.update()

    def make_optimizer(self, params: Iterable[torch.Tensor], cuda: bool = False
                       ) -> torch.optim.Optimizer | None:
        """The step's optimizer over `params` (None without one). `cuda`: as torch makes it
        for CUDA parameters, where `foreach=None` means the multi-tensor implementation
        (`torch/optim/optimizer.py`, `_default_to_fused_or_foreach`), whose temporaries are
        the update's peak; pre-flight's fake parameters are CPU tensors, on which torch
        would pick the single-tensor loop."""
        if self.optimizer is None:
            return None
        if isinstance(self.optimizer, str):
            return make_optimizer(self.optimizer, params, foreach=True if cuda else None)
        kwargs = dict(self.optimizer_kwargs)
        if cuda and not {"foreach", "fused"} & set(kwargs) and "foreach" in \
                inspect.signature(self.optimizer.__init__).parameters:
            kwargs["foreach"] = True
        try:
            return self.optimizer(list(params), **kwargs)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ConfigError(f"{self.optimizer.__name__}(**{dict(self.optimizer_kwargs)}) "
                              f"fails: {exc}"[:300]) from exc

    def make_scaler(self, device: torch.device) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(device.type) if self.scaled else None

    def describe(self) -> str:
        """One line for people: `bf16 autocast, 4 micro-batches, clip 1.0, AdamW`."""
        d = self.to_dict()
        parts = [f"{d['precision']} autocast" + (" + GradScaler" if d["scaler"] else "")
                 if self.autocast else f"{d['precision']} weights" if self.weights
                 else "fp32",
                 f"{self.micro_batches} micro-batch{'es' if self.micro_batches > 1 else ''}"]
        parts += [f"clip {self.clip:g}"] if self.clip is not None else []
        parts.append(str(d["optimizer"]).rsplit(".", 1)[-1] if self.optimizer else
                     "no optimizer")
        parts += ["gradients zeroed, not freed"] if not self.set_to_none else []
        parts += ["output dropped before backward"] if not self.output_in_backward else \
            ["output dropped after backward"] if not self.output_to_end else []
        parts += ["the user's step function"] if self.fn is not None else []
        parts += [self.layout.describe()] if self.layout is not None else []
        return ", ".join(parts)

    def to_dict(self) -> dict:
        """What a plan records of the step it was made for (JSON-ready)."""
        opt = self.optimizer
        low = self.autocast or self.weights
        return {"precision": str(low).removeprefix("torch.") if low else "fp32",
                "weights": str(self.weights).removeprefix("torch.") if self.weights else None,
                "micro_batches": self.micro_batches, "clip": self.clip,
                "optimizer": opt if opt is None or isinstance(opt, str)
                else f"{opt.__module__}.{opt.__qualname__}",
                "optimizer_kwargs": {k: v for k, v in dict(self.optimizer_kwargs).items()
                                     if isinstance(v, (bool, int, float, str))},
                "set_to_none": self.set_to_none, "scaler": self.scaled,
                "output_alive": self.output_alive, "step_fn": self.fn is not None,
                "layout": self.layout.to_dict() if self.layout is not None else None}


def as_step(step: Step | None = None, optimizer: Any = "momentum",
            loss_fn: LossFn | None = None) -> Step:
    """One `Step` from `step`, or from the older keywords (`optimizer=`, `loss_fn=`) that
    describe rematlab's own step; saying it both ways is refused, since the two could
    disagree."""
    if step is None:
        return Step(optimizer=optimizer, loss_fn=loss_fn)
    if not isinstance(step, Step):
        raise ConfigError(f"step must be a rematlab.Step, got {type(step).__name__}")
    if optimizer != "momentum" or loss_fn is not None:
        raise ConfigError("say the step once: optimizer= and loss_fn= belong inside "
                          "step=Step(...)")
    return step


def _check_optimizer(opt: Any, kwargs: Any) -> None:
    """An optimizer class and keywords the user's loop can run as `Step` runs it: keywords in
    a mapping of names, accepted by the class (tried on one probe parameter, so that a bad
    value fails here, not inside a profile), and a `step()` without a closure (L-BFGS
    re-evaluates the loss inside its step, a different loop from the one planned)."""
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ConfigError(f"optimizer_kwargs must be a mapping of keyword names to values, "
                          f"e.g. {{'lr': 1e-3}}, got {kwargs!r}"[:200])
    if not isinstance(opt, type):
        return
    closure = inspect.signature(opt.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ConfigError(f"{opt.__name__} needs a closure in step() (it re-evaluates the "
                          "loss), a loop rematlab does not plan: choose an optimizer whose "
                          "step() takes no arguments")
    try:
        opt([torch.zeros(1, requires_grad=True)], **kwargs)
    except Exception as exc:  # the user's class and keywords: bad input
        raise ConfigError(f"{opt.__name__}(**{dict(kwargs)}) fails: {one_line(exc)}"[:300]
                          ) from None


def optimizer_spec(optimizer: torch.optim.Optimizer) -> tuple[type, dict]:
    """The class and keywords that make an optimizer like `optimizer` (its `defaults`, less
    those its constructor does not take: torch's AdamW records `decoupled_weight_decay`)."""
    cls = type(optimizer)
    takes = inspect.signature(cls.__init__).parameters
    return cls, {k: v for k, v in optimizer.defaults.items() if k in takes}


def _device_of(model: Callable, batch: Batch) -> torch.device:
    first = next(tensors(batch), None)
    if first is not None:
        return first.device
    if isinstance(model, nn.Module):
        p = next(model.parameters(), None)
        if p is not None:
            return p.device
    return torch.device("cpu")
