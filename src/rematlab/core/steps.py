"""The user's training step: any batch form (`rematlab.core.batch`), the model's own loss, the
output alive until backward.

The loss is, in this order, the `loss_fn(output,
batch)` the user passes; the model's own loss (`output.loss` or `output["loss"]`, what
transformers returns when the batch has `labels`); cross-entropy against fixed random labels
for a `(B, classes)` output (the zoo's classifiers); the mean square of the first floating
output tensor otherwise (any shape: images, sequences, embeddings).

Budget semantics: the step whose peak a plan bounds is `out = model(batch); loss =
loss_fn(out, batch); loss.backward(); optimizer.step()`, with `out` alive until the step ends,
as in a real loop (a logits tensor that outlives backward is part of the peak), and the
optimizer's state and step included. The whole step, as the user's loop runs it (autocast,
micro-batches, clipping), is `rematlab.core.recipe.Step.train_step`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rematlab.core.batch import Batch, call, first_float
from rematlab.core.checks import one_line, user_code
from rematlab.core.dispatch import OpCall, Recorded
from rematlab.exceptions import ConfigError, OutOfMemory, SimulatedOOM

LossFn = Callable[[Any, Batch], torch.Tensor]  # loss_fn(output, batch), as the user gives it
PHASES = ("forward", "backward", "optimizer")


def model_loss(out: Any) -> torch.Tensor | None:
    """The loss a model computed itself (transformers with `labels`), if any."""
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None


def labels_for(logits: torch.Tensor) -> torch.Tensor:
    """Fixed random class labels for a `(B, classes)` output, the same on every call."""
    gen = torch.Generator().manual_seed(0)
    b, classes = logits.shape
    return torch.randint(0, classes, (b,), generator=gen).to(logits.device)


def default_loss(out: Any, batch: Batch) -> torch.Tensor:
    """See the module docstring: the model's own loss, cross-entropy for classifiers, else
    the mean square of the output."""
    del batch  # the default never looks at the batch: its labels are inside `out.loss`
    loss = model_loss(out)
    if loss is not None:
        return loss
    y = first_float(out)
    if y is None:
        raise ConfigError(f"the model's output ({type(out).__name__}) holds no floating tensor "
                          "to take a loss of: pass loss_fn")
    if y.dim() == 2:
        return F.cross_entropy(y, labels_for(y))
    return y.square().mean()


def forward(model: Callable, batch: Batch, loss_fn: LossFn | None = None
            ) -> tuple[Any, torch.Tensor]:
    """The output of `model` on `batch` and its loss (the user's, or `default_loss`), one
    backward can start from (`checked_loss`); what the user's `loss_fn` raises is theirs."""
    out = call(model, batch)
    return out, loss_of(out, batch, loss_fn)


def loss_of(out: Any, batch: Batch, loss_fn: LossFn | None = None) -> torch.Tensor:
    """The loss of `out`: the user's `loss_fn(out, batch)` (what it raises is theirs), else
    `default_loss`; checked (`checked_loss`)."""
    if loss_fn is None:
        return checked_loss(default_loss(out, batch), "the model's loss")
    with user_code("the loss function fails", passes=is_oom):
        loss = loss_fn(out, batch)
    return checked_loss(loss, "the loss function")


def checked_loss(loss: object, source: str) -> torch.Tensor:
    """`loss` if backward can start from it: a real floating-point scalar that requires
    grad (when gradients are on). Anything else is the user's input, said in one line,
    rather than autograd's error from deep inside the step."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
               else type(loss).__name__)
        raise ConfigError(f"{source} must give the loss as a scalar tensor, got {got}")
    if not loss.is_floating_point():
        raise ConfigError(f"{source} gave a {str(loss.dtype).removeprefix('torch.')} loss: "
                          "backward starts from a real floating-point scalar")
    if torch.is_grad_enabled() and not loss.requires_grad:
        raise ConfigError(f"{source} gave a loss that does not require grad (computed under "
                          "torch.no_grad(), detached, a constant, or from no trainable "
                          "parameter): backward cannot start from it")
    return loss


@contextlib.contextmanager
def preserved(module: nn.Module) -> Iterator[None]:
    """Run a throw-away step: gradients, buffers and the RNG are as before afterwards."""
    grads = [p.grad for p in module.parameters()]
    buffers = [b.detach().clone() for b in module.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    for p in module.parameters():
        p.grad = None
    try:
        yield
    finally:
        for p, g in zip(module.parameters(), grads, strict=True):
            p.grad = g
        with torch.no_grad():
            for b, saved in zip(module.buffers(), buffers, strict=True):
                b.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def is_oom(exc: BaseException) -> bool:
    """Whether an exception means the device ran out of memory (a result, not a failure)."""
    if isinstance(exc, (SimulatedOOM, MemoryError)):
        return True
    if torch.cuda.is_available() and isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc)
    return "out of memory" in text.lower() or "can't allocate memory" in text


@contextlib.contextmanager
def out_of_memory(what: str) -> Iterator[None]:
    """Running out of memory inside as `OutOfMemory` (a rematlab error: one line from the
    CLI) saying `what` ran out; other errors pass as they are."""
    try:
        yield
    except OutOfMemory:
        raise
    except Exception as exc:
        if not is_oom(exc):
            raise
        raise OutOfMemory(f"{what} ran out of memory ({one_line(exc)})") from exc


def runs_on(model: nn.Module, run: Callable, batch: Batch, name: str) -> None:
    """One no-grad forward of `run` on `batch`, `model`'s state restored: a model that cannot
    take the batch (wrong shape, dtype, vocabulary, device) is bad input, said in one line,
    before anything is profiled or measured. Running out of memory is passed on as it is."""
    devices = _Devices() if _cuda_unreachable() else None
    try:
        with torch.no_grad(), preserved(model), devices or contextlib.nullcontext():
            call(run, batch)
    except Exception as exc:
        if is_oom(exc):
            raise
        raise ConfigError(f"{name} fails on the batch: {one_line(exc)}"[:300]) from exc
    if devices is not None and "cuda" in devices.types:
        raise ConfigError(f"{name} fails on the batch: it moves tensors to cuda, and torch "
                          "finds no CUDA/ROCm device on this machine")


def _cuda_unreachable() -> bool:
    """A CUDA build of torch on a machine without a GPU: there a fake tensor (pre-flight) goes
    to `cuda` without complaint, and only its backward fails, inside autograd's engine; a
    CPU build refuses at once."""
    return torch.backends.cuda.is_built() and not torch.cuda.is_available()


class _Devices(Recorded):
    """The device types the ops of a run put tensors on."""

    def __init__(self) -> None:
        self.types: set[str] = set()

    def on_op(self, call: OpCall) -> None:
        self.types.update(t.device.type for t in call.outs)


def unit_loss(out: torch.Tensor) -> torch.Tensor:
    """sum(out * 1): its backward makes the output gradient inside autograd, which frees it
    once consumed, as in a real step (a gradient passed in from outside would stay alive)."""
    return (out * torch.ones((), dtype=out.dtype, device=out.device).expand_as(out)).sum()


class Phases:
    """What a caller puts around a block's two phases in `block_step`: a context around the
    forward, what it reads of the output before the backward (the output itself is not
    kept), and a context around the backward. The base class puts nothing."""

    def forward(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def forwarded(self, out: torch.Tensor) -> None:
        """Called with the output once the forward ends."""

    def backward(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def block_step(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
               phases: Phases | None = None) -> bool:
    """One forward of `run` on `x` and, when its output needs a gradient, the backward of
    `unit_loss` (made before the backward phase: a block's backward starts from its output
    gradient): the one loop of a block, a layer or a calibration piece run alone (profiles,
    option costs, the timer's block times, compiled warm-up, calibration), as `Step` is the
    one loop of a model's training step. `phases` puts the caller's instruments around each
    phase. Whether the backward ran."""
    phases = phases or Phases()
    with phases.forward():
        out = run(x)
    phases.forwarded(out)
    if not out.requires_grad:
        return False
    loss = unit_loss(out)
    del out  # autograd alone decides when the output dies, as in a real step
    with phases.backward():
        loss.backward()
    return True
