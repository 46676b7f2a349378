"""Lightning: a `Callback` that plans the LightningModule's model for the step the Trainer
runs, on the first training batch, and installs the plan in place.

What is read: `trainer.precision` (`"bf16-mixed"`, `"16-mixed"` with a GradScaler, `"32-true"`,
...), `accumulate_grad_batches` (micro-batches), `gradient_clip_val` (clipping by norm), the
class and defaults of the optimizer `configure_optimizers` made, and the first batch. The
plan is made for the module's `attr` (default `"model"`, where a LightningModule usually
keeps its network), and the step priced is the module's own `training_step` with the planned
network in its place, however it hands the batch to the network (`x, y = batch`, a dict);
with `loss_fn`, the network on the batch and `loss_fn(out, batch)`. Either way the output
dies before backward (`training_step` returns the loss).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from torch import nn

from rematlab.core.recipe import Step, StepFn, optimizer_spec
from rematlab.core.steps import LossFn
from rematlab.exceptions import ConfigError
from rematlab.integrations import checked
from rematlab.planning.planner import prepare
from rematlab.plans.plan import Plan
from rematlab.remat.strategies import apply


def _callback_base() -> type:
    try:
        from lightning.pytorch.callbacks import Callback
    except ImportError as exc:  # pragma: no cover - CI installs it
        raise ConfigError("rematlab's Lightning callback needs lightning: pip install "
                          "lightning") from exc
    return Callback


def trainer_step(trainer: Any, loss_fn: LossFn | None = None) -> Step:
    """The `Step` a Lightning `trainer` runs (module docstring)."""
    optimizers = trainer.optimizers
    if len(optimizers) > 1:
        raise ConfigError("rematlab plans steps with one optimizer; this module has "
                          f"{len(optimizers)}")
    opt = optimizers[0] if optimizers else None
    clip = trainer.gradient_clip_val
    if clip and trainer.gradient_clip_algorithm not in (None, "norm"):
        raise ConfigError("rematlab prices clipping by norm (gradient_clip_algorithm='norm')")
    cls, kwargs = optimizer_spec(opt) if opt is not None else (None, {})
    return Step(precision=str(trainer.precision), micro_batches=trainer.accumulate_grad_batches,
                clip=float(clip) if clip else None, optimizer=cls, optimizer_kwargs=kwargs,
                loss_fn=loss_fn, output_alive="forward")  # training_step returns the loss


def RematCallback(budget: str | int = "auto", attr: str = "model",
                  loss_fn: LossFn | None = None, **kwargs: Any) -> Any:
    """A Lightning callback planning `pl_module.<attr>` within `budget` on the first
    training batch (other keywords are `rematlab.prepare`'s); the plan is `callback.plan`.
    The step planned is the module's own `training_step` with the planned network in
    place of `<attr>` (its `self.log` calls silenced while it is priced), however it hands
    the batch to the network; with `loss_fn`, the network on the batch and
    `loss_fn(out, batch)`. Checked when made; `<attr>` when the fit begins (`setup`)."""
    base = _callback_base()
    checked("RematCallback", budget, kwargs)
    if not (isinstance(attr, str) and attr.isidentifier()):
        raise ConfigError(f"attr names the LightningModule's network attribute, e.g. 'model', "
                          f"got {attr!r}"[:200])
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError("loss_fn must be callable")

    class _Remat(base):
        def __init__(self) -> None:
            super().__init__()
            self.plan: Plan | None = None

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            network(pl_module, attr)
            if not pl_module.automatic_optimization:
                raise ConfigError("rematlab plans Lightning's automatic optimization; this "
                                  "module optimizes manually (automatic_optimization=False)")

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                                 batch_idx: int) -> None:
            if self.plan is not None:
                return
            model = network(pl_module, attr)
            step = trainer_step(trainer, loss_fn)
            if loss_fn is None:
                step = replace(step, fn=_training_step(pl_module, attr, batch_idx))
            self.plan = prepare(model, batch, step=step, **kwargs).choose(budget)
            setattr(pl_module, attr, apply(model, self.plan, example_input=batch))

    return _Remat()


def network(pl_module: Any, attr: str) -> nn.Module:
    """The network the callback plans: `pl_module.<attr>`, an `nn.Module`."""
    model = getattr(pl_module, attr, None)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{type(pl_module).__name__}.{attr} is "
                          f"{'missing' if model is None else type(model).__name__}, not the "
                          "network: name it with RematCallback(attr=...)")
    return model


def _training_step(pl_module: Any, attr: str, batch_idx: int) -> StepFn:
    """The module's `training_step` as a step function: the network given in place of
    `<attr>` while it runs, its loss (a tensor, or a dict's "loss"), and nothing logged."""

    def fn(model: nn.Module, batch: Any) -> Any:
        original = getattr(pl_module, attr)
        setattr(pl_module, attr, model)
        pl_module.log = pl_module.log_dict = lambda *_a, **_k: None
        try:
            out = pl_module.training_step(batch, batch_idx)
        finally:
            setattr(pl_module, attr, original)
            del pl_module.log, pl_module.log_dict
        return out.get("loss") if isinstance(out, Mapping) else out
    return fn
