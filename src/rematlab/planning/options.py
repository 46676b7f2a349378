"""How a model is planned, in one object: `PlanOptions`, which `prepare`, `plan`,
`max_batch`, `auto`, the trainers' callbacks and the CLI take, validated once, with one set
of messages, when it is made.

The training step (optimizer, loss, autocast, micro-batches, layout) is another concern,
with its own object (`rematlab.core.recipe.Step`); what to profile, once the options are
resolved against a device, is the profilers' (`rematlab.remat.profiling.Profiling`). The
keywords rematlab has always taken (`prepare(model, batch, ops=True, optimizer="adamw")`)
still work: `request` sorts them into the options and the step, and refuses any other with
the list of those it knows, as torchtitan's job config refuses an unknown field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from rematlab.core.checks import bounded, device_here
from rematlab.core.recipe import Step, as_step
from rematlab.exceptions import ConfigError
from rematlab.measurement.spec import MAX_REPEATS
from rematlab.preflight.targets import Target
from rematlab.remat.profiling import COMPILED_NOT_OFFLOADED, COMPILED_NOT_PREDICTED

FRACTIONS = (0.0, 0.5, 1.0)  # each costs a compile and a timing run: a few, 0 and 1 among them
STEP_KEYWORDS = ("optimizer", "loss_fn")  # shorthand for step=Step(optimizer=..., loss_fn=...)


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """How to plan one model (see `rematlab.plan` for each one's effect).

    `device`: where measured costs are taken (default: the batch's); `blocks`: the layers of
    a model that runs its own loop (`rematlab.remat.structure`); `predict`: plan without
    running, from fake tensors and `target`'s roofline (a name such as "h100-80gb", "cpu",
    a profile); `verify`: measure the chosen plan's step and tighten on a miss; `compile`:
    plan for `torch.compile(apply(model, plan))`, with torch.compile's own budget at each of
    `fractions` as candidates; `ops`: offer op-level options per block; `offload`: offer
    each layer's saved activations in host memory as a third choice beside keeping and
    recomputing (`rematlab.plans.offload`; on a GPU, or a GPU target); `repeats`: timed runs
    per profiled block (None: 1 on a CPU, 3 on a GPU)."""

    device: str | torch.device | None = None
    blocks: list[nn.Module] | str | list[str] | None = None
    predict: bool = False
    target: str | Target | dict | None = None
    verify: bool = True
    compile: bool = False
    ops: bool = False
    offload: bool = False
    fractions: tuple[float, ...] = FRACTIONS
    repeats: int | None = None

    def __post_init__(self) -> None:
        for name in ("predict", "verify", "compile", "ops", "offload"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"{name} must be True or False, got {value!r}")
        if self.compile and self.predict:
            raise ConfigError(COMPILED_NOT_PREDICTED)
        if self.offload and self.compile:
            raise ConfigError(COMPILED_NOT_OFFLOADED)
        if self.target is not None and not self.predict:
            raise ConfigError("a target is planned for without running: it needs "
                              "predict=True (--predict); without it, plans are measured on "
                              "the device the batch is on")
        if self.device is not None:
            device_here(self.device)
        if self.target is not None and (not isinstance(self.target, (str, Target, dict))
                                        or (isinstance(self.target, str) and not self.target)):
            raise ConfigError(f"target must be a profile name (such as 'h100-80gb'), a "
                              f"profile.json, a dict of a profile's fields or a Target, got "
                              f"{self.target!r}"[:200])
        blocks = self.blocks
        if blocks is not None and not (
                (isinstance(blocks, str) and blocks.strip(", "))
                or (isinstance(blocks, (list, tuple)) and blocks
                and (all(isinstance(b, nn.Module) for b in blocks)
                     or all(isinstance(b, str) and b for b in blocks)))):
            raise ConfigError(f"blocks must name at least one layer: modules, names of "
                              f"submodules ('transformer.h'), or one comma-separated string; "
                              f"got {blocks!r}"[:200])
        fractions = self.fractions
        if not isinstance(fractions, (tuple, list)) or not all(
                isinstance(f, (int, float)) and not isinstance(f, bool) and 0.0 <= f <= 1.0
                for f in fractions):  # none: torch.compile's own budget is no candidate
            raise ConfigError(f"fractions must be a list of numbers in [0, 1], got "
                              f"{fractions!r}")
        object.__setattr__(self, "fractions", tuple(float(f) for f in fractions))
        repeats = self.repeats
        if repeats is not None:
            if not isinstance(repeats, int) or isinstance(repeats, bool):
                raise ConfigError(f"repeats must be a whole number, got {repeats!r}")
            bounded("repeats", repeats, MAX_REPEATS)

    def repeats_on(self, device: torch.device) -> int:
        """Timed runs per profiled block on `device`: one on a CPU (its steps are long), three
        on a GPU, unless given."""
        if self.repeats is not None:
            return self.repeats
        return 1 if device.type == "cpu" else 3


NAMES = frozenset(f.name for f in dataclasses.fields(PlanOptions))
_generated_init = PlanOptions.__init__


def _init(self: PlanOptions, *args: Any, **fields: Any) -> None:
    """`PlanOptions(...)` by keywords only, each a field it has: anything else is refused
    with the fields' names, as planning's keywords are (`request`)."""
    if args:
        raise ConfigError(f"PlanOptions takes keywords only ({', '.join(sorted(NAMES))})")
    unknown = sorted(set(fields) - NAMES)
    if unknown:
        raise ConfigError(f"unknown PlanOptions field(s) {', '.join(unknown)}; it has "
                          f"{', '.join(sorted(NAMES))}")
    _generated_init(self, **fields)


PlanOptions.__init__ = _init  # type: ignore[method-assign]


def request(options: PlanOptions | None, step: Step | None, keywords: dict[str, Any]
            ) -> tuple[PlanOptions, Step]:
    """The options and the step of one call: `options` with the `keywords` that name
    options changed, and `step` (or rematlab's own, from `optimizer=`/`loss_fn=`). Any other
    keyword is refused with the names known."""
    if options is not None and not isinstance(options, PlanOptions):
        raise ConfigError(f"options must be a rematlab.PlanOptions, got "
                          f"{type(options).__name__}")
    unknown = sorted(set(keywords) - NAMES - set(STEP_KEYWORDS))
    if unknown:
        raise ConfigError(f"unknown keyword(s) {', '.join(unknown)}; planning takes "
                          f"{', '.join(sorted(NAMES | set(STEP_KEYWORDS)))} and step")
    changes = {k: v for k, v in keywords.items() if k in NAMES}
    opts = replace(options or PlanOptions(), **changes)  # validated again when changed
    return opts, as_step(step, **{k: keywords[k] for k in STEP_KEYWORDS if k in keywords})
