"""Fake runs shared between the cards one model is priced for (`rematlab rent`).

A fake run's bytes, ops and allocation trace depend on the model, the batch's shapes, the
step and the kind of target (CUDA or not), not on which card of that kind it is priced for:
a card changes the times (the roofline prices the ops a run kept) and what the allocator may
reserve (its capacity), and a data-parallel layout changes what a rank holds
(`rematlab.planning.ranks`), not the run. Inside `shared_runs()`, pre-flight keeps each such
run by what it depends on (`model_key` plus what the caller adds) and reuses it for the
next card instead of running it again.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TypeVar

from torch import nn

from rematlab.core.batch import Batch, tensors
from rematlab.core.recipe import Step

T = TypeVar("T")

_RUNS: contextvars.ContextVar[dict[tuple, object] | None] = contextvars.ContextVar(
    "rematlab_shared_runs", default=None)


@contextlib.contextmanager
def shared_runs() -> Iterator[None]:
    """Within it, each fake run is made once and reused (module docstring): a run is found
    by the model's class, its parameters' names, shapes and dtypes, the batch's shapes and
    the step, not by identity. A scope inside another shares the outer one's runs."""
    if _RUNS.get() is not None:
        yield
        return
    token = _RUNS.set({})
    try:
        yield
    finally:
        _RUNS.reset(token)


def model_key(model: nn.Module, batch: Batch, step: Step) -> tuple:
    """What every fake run of `model` on `batch` under `step` depends on, the step's layout
    left out (it shards what a rank holds after the run, not the run)."""
    step = replace(step, layout=None)
    return (type(model).__qualname__,
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                  for n, p in model.named_parameters()),
            tuple((tuple(t.shape), t.dtype) for t in tensors(batch)),
            json.dumps(step.to_dict(), sort_keys=True, default=repr), step.optimizer,
            step.fn, step.loss_fn)


def shared(key: tuple | None, run: Callable[[], T]) -> T:
    """`run()`'s result, made once per `key` inside `shared_runs()`; outside it, or with no
    key (a run that cannot be shared), simply `run()`."""
    runs = _RUNS.get()
    if runs is None or key is None:
        return run()
    if key not in runs:
        runs[key] = run()
    return runs[key]  # type: ignore[return-value]
