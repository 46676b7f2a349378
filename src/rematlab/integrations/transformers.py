"""Hugging Face `Trainer`: plan the model for the step the Trainer will run, from its own
settings, and hand the planned model back to it.

What is read: `bf16`/`fp16` (autocast, fp16 with a GradScaler), `gradient_accumulation_steps`
(micro-batches), `max_grad_norm` (clipping, when > 0), the optimizer class and keywords
`optim` resolves to (`Trainer.get_optimizer_cls_and_kwargs`, or the `optimizers=` the Trainer
was given), and the first batch of the Trainer's own train dataloader (its collator, its
`per_device_train_batch_size`, its column filter). The model's output dies before backward
(`compute_loss` returns the loss alone). `gradient_checkpointing=True` is refused: a plan
replaces it.
"""

from __future__ import annotations

from typing import Any

import torch

from rematlab.core.batch import tensors
from rematlab.core.recipe import Step, optimizer_spec
from rematlab.exceptions import ConfigError
from rematlab.integrations import checked
from rematlab.planning.planner import prepare
from rematlab.plans.plan import Plan
from rematlab.remat.strategies import apply


def trainer_step(trainer: Any) -> Step:
    """The `Step` `trainer` runs (module docstring)."""
    args = trainer.args
    if getattr(args, "activation_checkpointing", False) or args.gradient_checkpointing:
        raise ConfigError("the Trainer's gradient_checkpointing=True would checkpoint inside "
                          "the plan: leave it off, the plan replaces it")
    if trainer.optimizer is not None:
        opt_cls, opt_kwargs = optimizer_spec(trainer.optimizer)
    else:
        opt_cls, opt_kwargs = trainer.get_optimizer_cls_and_kwargs(args, trainer.model)
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    return Step(precision=precision, micro_batches=args.gradient_accumulation_steps,
                clip=args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0
                else None,
                optimizer=opt_cls, optimizer_kwargs=opt_kwargs,
                output_alive="forward")  # compute_loss returns the loss alone


def plan_trainer(trainer: Any, budget: str | int = "auto", **kwargs: Any) -> Plan:
    """Plan `trainer.model` for the Trainer's own step and first batch within `budget`
    (bytes, '6GiB' or 'auto'), install the planned model in the Trainer (before
    `trainer.train()`), and return the plan. Other keywords are `rematlab.prepare`'s
    (`blocks`, `ops`, `compile`)."""
    checked("plan_trainer", budget, kwargs)
    step = trainer_step(trainer)
    data = trainer.train_dataset
    if data is None or (hasattr(data, "__len__") and len(data) == 0):
        raise ConfigError("the Trainer has no training data (train_dataset is "
                          f"{'None' if data is None else 'empty'}): a plan is made on its "
                          "first batch")
    # reading a batch draws the sampler's seed from torch's RNG: the user's run must see the
    # same stream (the same data order, the same dropout masks) as without rematlab
    with torch.random.fork_rng(devices=[]):
        batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
        batch = {k: v for k, v in batch.items() if any(True for _ in tensors(v))}
        chosen = prepare(trainer.model, batch, step=step, **kwargs).choose(budget)
    trainer.model = trainer.model_wrapped = apply(trainer.model, chosen, example_input=batch)
    return chosen
