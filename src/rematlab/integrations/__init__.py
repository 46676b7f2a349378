"""Thin bridges to the trainers users run, one module per library, each importing its library
lazily: they read the trainer's settings into a `rematlab.Step` and call the public API.
What they are given is checked when they are made, not at the first batch (`checked`)."""

from __future__ import annotations

import inspect
from typing import Any

from rematlab.exceptions import ConfigError
from rematlab.planning.budget import checked as checked_budget

# what a trainer's own settings say, so not a keyword of the bridges
_FROM_TRAINER = {"model", "example_inputs", "step", "optimizer", "loss_fn"}


def checked(where: str, budget: str | int, kwargs: dict[str, Any]) -> None:
    """`budget` a size or "auto", and `kwargs` keywords `rematlab.prepare` takes, other than
    those the trainer's settings give: bad ones said in one line when the bridge is made."""
    from rematlab.planning.planner import prepare

    checked_budget(budget)
    takes = set(inspect.signature(prepare).parameters) - _FROM_TRAINER
    unknown = sorted(set(kwargs) - takes)
    if unknown:
        raise ConfigError(f"{where} got {', '.join(unknown)}: its other keywords are "
                          f"rematlab.prepare's ({', '.join(sorted(takes))})")
