"""`rematlab.auto`: a model wrapped so that it plans on its first training batch and again
for each new bucket of input shapes (`rematlab.planning.shapes`), and when a derived budget
stops holding."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rematlab.core.batch import call, detached, tensors
from rematlab.core.recipe import Step
from rematlab.core.units import format_bytes
from rematlab.exceptions import ConfigError
from rematlab.planning.budget import checked, derive, is_auto
from rematlab.planning.options import PlanOptions, request
from rematlab.planning.planner import Planning, prepare
from rematlab.planning.shapes import ShapeBuckets, Shapes, covers, shapes_of, tiled
from rematlab.plans.plan import Plan
from rematlab.remat.strategies import apply

_log = logging.getLogger("rematlab")


@dataclass(frozen=True)
class Replan:
    """One plan `AutoRemat` made: for which input shapes (the batch's; `profiled`, the
    bucket's largest, where it was made), why, within which budget."""

    shapes: tuple
    reason: str
    budget: int
    plan: str
    peak: int
    profiled: tuple = ()


class AutoRemat(nn.Module):
    """Plans on the first training batch and again for each new bucket of input shapes
    (`rematlab.planning.shapes`: the dimensions that change, rounded up to powers of two; the
    plan is made at the bucket's largest shape and reused for every shape it covers), so
    dynamic padding profiles a few times, not every step; `shape_buckets=False` plans every
    exact shape. Evaluation and no-grad calls run the model plainly. Takes the model's own
    arguments (a tensor, several, or keywords as a Hugging Face model does).

    With `budget="auto"` the budget is derived from the device for every new bucket, and
    derived again at most every `recheck_s` seconds of training calls: a cached plan whose
    peak no longer fits (another process took memory) is re-planned, and so is one that
    checkpoints while the budget has grown by more than `REGROW` (memory was freed: a faster
    plan may fit). Every plan is logged on the `rematlab` logger and kept in `events`;
    `planned` counts them."""

    REGROW = 1.25

    def __init__(self, model: nn.Module, budget: str | int, options: PlanOptions | None = None,
                 *, recheck_s: float = 10.0, step: Step | None = None,
                 shape_buckets: bool = True, **keywords: Any) -> None:
        super().__init__()
        self.model = model
        self.budget = checked(budget)  # 'auto' is derived again for every new shape
        self.options, self.step = request(options, step, keywords)  # plan's keywords too
        if not isinstance(shape_buckets, bool):
            raise ConfigError(f"shape_buckets must be True or False, got {shape_buckets!r}")
        if not isinstance(recheck_s, (int, float)) or isinstance(recheck_s, bool) \
                or not 0 <= recheck_s < math.inf:
            raise ConfigError(f"recheck_s must be a number of seconds, 0 or more, got "
                              f"{recheck_s!r}"[:200])
        self.recheck_s = recheck_s
        self.shape_buckets = shape_buckets
        self.plans: dict[tuple, nn.Module] = {}  # by bucket: (dtypes and devices, shapes)
        self.events: list[Replan] = []
        self._buckets = ShapeBuckets()
        self._profiled: dict[tuple, Shapes] = {}  # the shapes each bucket's plan was made at
        self._untiled: set[tuple] = set()  # buckets whose largest shapes the model refused
        self._chosen: dict[tuple, Plan] = {}
        self._state: dict[tuple, int] = {}  # optimizer-state bytes each plan counted
        self._checked = time.monotonic()
        self._stepped = False  # after a training call the optimizer's state exists

    @property
    def planned(self) -> int:
        """How many times this wrapper has profiled and planned."""
        return len(self.events)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return self.model(*args, **kwargs)
        batch: Any = kwargs if not args else (args[0] if len(args) == 1 and not kwargs
                                              else args)
        if args and kwargs:
            raise ConfigError("auto() takes positional or keyword inputs, not both")
        shapes = self._shapes(batch)
        key, planned = self._bucket(batch, shapes)
        if not planned:
            self._plan(key, batch, shapes, "new input shapes")
        elif is_auto(self.budget) and not self._ranked() \
                and time.monotonic() - self._checked >= self.recheck_s:
            self._recheck(key, batch, shapes)
        self._stepped = True
        return call(self.plans[key], batch)

    def _ranked(self) -> bool:
        """Whether this is one rank of a sharded job (a layout, or a model already under
        `fully_shard`/DDP, in an initialised process group): planning then runs collectives,
        so every rank must plan the same shapes at the same calls. A derived budget is then
        not re-derived on a timer either, which would fire at different calls per rank."""
        from torch.distributed.tensor import DTensor

        return dist.is_available() and dist.is_initialized() and (
            self.step.layout is not None
            or any(isinstance(p, DTensor) for p in self.model.parameters()))

    def _shapes(self, batch: Any) -> Shapes:
        """The batch's shapes; on the ranks of a sharded job (`_ranked`), each dimension's
        largest on any rank, so that all of them plan one bucket at one call (a rank's own
        batch is tiled up to it)."""
        shapes = shapes_of(batch)
        if not self._ranked():
            return shapes
        sizes = torch.tensor([d for s in shapes for d in s], dtype=torch.int64,
                             device=next(tensors(batch)).device)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
        flat = iter(sizes.tolist())
        return tuple(tuple(next(flat) for _ in s) for s in shapes)

    def _bucket(self, batch: Any, shapes: Shapes) -> tuple[tuple, bool]:
        """The key of `batch`'s plan — its tensors' dtypes and devices, and the bucket's
        largest of `shapes` (`_shapes`; themselves without buckets) — and whether a plan
        covering the batch is there. A bucket with none yet takes that of an earlier bucket made at
        shapes covering the batch, if any (the first batch's, made before any dimension was
        seen to change); until a plan is made at the bucket's largest shapes, a larger batch
        in it is planned again."""
        kinds = tuple((t.dtype, t.device) for t in tensors(batch))
        if not self.shape_buckets:
            return (kinds, shapes), (kinds, shapes) in self.plans
        self._buckets.observe(shapes)
        key = (kinds, self._buckets.top(shapes))
        if key in self.plans and covers(self._profiled[key], shapes):
            return key, True
        earlier = next((k for k, made in self._profiled.items()
                        if k[0] == kinds and covers(made, shapes)
                        and self._buckets.top(made) == key[1]), None)
        if earlier is None:
            return key, False
        for table in (self.plans, self._profiled, self._chosen, self._state):
            table[key] = table[earlier]
        return key, True

    def _recheck(self, key: tuple, batch: Any, shapes: Shapes) -> None:
        """Derive the budget again; re-plan when the cached plan no longer fits it, or when
        it checkpoints and the budget has grown."""
        self._checked = time.monotonic()
        chosen = self._chosen[key]
        now = derive(self.budget, self.model, batch, self._state[key]).nbytes
        peak = chosen.measured_peak or chosen.predicted_peak or 0
        if peak > now:
            self._plan(key, batch, shapes, f"budget fell to {format_bytes(now)}, below the plan's "
                                   f"peak {format_bytes(peak)}")
        elif chosen.segments and now > self.REGROW * (chosen.budget or now):
            self._plan(key, batch, shapes, f"budget grew to {format_bytes(now)} from "
                                   f"{format_bytes(chosen.budget or 0)}")

    def _plan(self, key: tuple, batch: Any, shapes: Shapes, reason: str) -> None:
        """Plan at the bucket's largest shapes (the batch tiled up to them); at the batch's
        `shapes` (its own, or the largest over the ranks) where the model cannot take those
        (a sequence past its position table), from then on for that bucket."""
        own = tiled(detached(batch), shapes)
        example = own if key in self._untiled else tiled(detached(batch), key[1])
        try:
            planning = self._prepare(example)
        except ConfigError as exc:
            if shapes_of(example) == shapes:
                raise
            _log.info("rematlab.auto: planning at the batch's own shapes: the bucket's "
                      "largest (%s) failed: %s", key[1], exc)
            self._untiled.add(key)
            example = own
            planning = self._prepare(example)
        # after a training call the user's optimizer holds its state: resident, as the
        # parameters are (CPU; on CUDA the process's held memory already counts it)
        state = planning.costs.state if self._stepped else 0
        derived = derive(self.budget, self.model, example, state)
        chosen = planning.choose(derived.nbytes)
        self._chosen[key], self._state[key] = chosen, planning.costs.state
        self._profiled[key] = shapes_of(example)
        self.plans[key] = apply(self.model, chosen, blocks=self.options.blocks,
                                example_input=example)
        event = Replan(shapes_of(batch), reason, derived.nbytes, chosen.describe(),
                       chosen.measured_peak or chosen.predicted_peak or 0, shapes_of(example))
        self.events.append(event)
        _log.info("rematlab.auto: plan %d, %s, for shapes %s (profiled at %s; %s): budget %s "
                  "(%s)", self.planned, event.plan, event.shapes, event.profiled, reason,
                  format_bytes(derived.nbytes), derived.how)

    def _prepare(self, example: Any) -> Planning:
        return prepare(self.model, example, self.options, step=self.step)


def auto(model: nn.Module, budget: str | int, options: PlanOptions | None = None,
         **kwargs: Any) -> AutoRemat:
    """`model` wrapped so that every new input shape gets its own optimal plan."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"auto() needs an nn.Module, got {type(model).__name__}")
    return AutoRemat(model, budget, options, **kwargs)
