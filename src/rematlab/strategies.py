"""Rematerialization strategies: parse them, turn them into plans, and run plans.

Every strategy — `none`, `uniform:N`, `every:K`, `selective[:T]`, `sqrt`, an explicit `Plan`
or `plan:FILE.json` — compiles to a `Plan` over the model's chain of blocks, and one executor
runs any plan with non-reentrant `torch.utils.checkpoint`. The same strings work in Python,
on the CLI and in grid files.

.. warning::
   Recomputation runs the forward of a segment a second time. Dropout masks are reproduced
   (the RNG state is saved and restored), and BatchNorm running statistics are *not* updated a
   second time: during recomputation every BatchNorm of the segment normalises with batch
   statistics, exactly as in the original training-mode forward, with its running buffers
   left as they are. Other modules with side effects in forward would repeat them.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from rematlab import plans
from rematlab.exceptions import ConfigError
from rematlab.plans import ChainCosts, Item, Plan, Segment

_PATTERN = re.compile(r"^(none|sqrt|selective|uniform|every|plan)(?::(.+))?$")
NAMES = ("none", "uniform:N", "every:K", "selective[:T]", "sqrt", "plan:FILE.json")


@dataclass(frozen=True)
class Strategy:
    """A parsed strategy string; `build` turns it into a plan for an n-block chain."""

    kind: str
    arg: float | None = None
    path: str | None = None

    @property
    def needs_costs(self) -> bool:
        return self.kind == "selective"

    def __str__(self) -> str:
        if self.kind == "plan":
            return f"plan:{self.path}"
        if self.arg is None:
            return self.kind
        return f"{self.kind}:{self.arg:g}"

    def build(self, n: int, costs: ChainCosts | None = None) -> Plan:
        if self.kind == "none":
            return plans.none_plan(n)
        if self.kind == "sqrt":
            return plans.sqrt_plan(n)
        if self.kind == "uniform":
            return plans.uniform_plan(n, int(self.arg or 1))
        if self.kind == "every":
            return plans.every_plan(n, int(self.arg or 1))
        if self.kind == "selective":
            if costs is None:
                raise ConfigError("strategy 'selective' needs per-block costs")
            return plans.selective_plan(costs, 1.0 if self.arg is None else self.arg)
        with open(str(self.path), encoding="utf-8") as fh:
            loaded = Plan.from_json(fh.read())
        if loaded.n_blocks != n:
            raise ConfigError(f"plan {self.path} is for {loaded.n_blocks} blocks, model has {n}")
        return loaded


def parse(text: str) -> Strategy:
    """Parse a strategy string; a `ConfigError` names the bad value and the allowed forms."""
    m = _PATTERN.match(text.strip())
    if not m:
        raise ConfigError(f"unknown strategy {text!r}; expected one of {', '.join(NAMES)}")
    kind, arg = m.group(1), m.group(2)
    if kind == "plan":
        if not arg:
            raise ConfigError("strategy 'plan' needs a file: plan:FILE.json")
        return Strategy(kind, path=arg)
    if kind in ("none", "sqrt"):
        if arg is not None:
            raise ConfigError(f"strategy {kind!r} takes no argument, got {text!r}")
        return Strategy(kind)
    if arg is None:
        if kind == "selective":
            return Strategy(kind)
        raise ConfigError(f"strategy {kind!r} needs a positive integer, e.g. {kind}:4")
    try:
        value = float(arg) if kind == "selective" else int(arg)
    except ValueError:
        raise ConfigError(f"strategy {text!r}: {arg!r} is not a number") from None
    if value <= 0:
        raise ConfigError(f"strategy {text!r}: the argument must be positive")
    return Strategy(kind, float(value))


class RecomputeStats:
    """What recomputation costs during backward: seconds, segments recomputed and, when
    `count_flops` is set, FLOPs. Nested recomputation is counted inside its outermost region."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.segments = 0
        self.flops = 0
        self.count_flops = False
        self._depth = 0

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        outermost = self._depth == 0
        t0 = time.perf_counter()
        counter = FlopCounterMode(display=False) if outermost and self.count_flops else None
        self._depth += 1
        try:
            with counter if counter is not None else contextlib.nullcontext():
                yield
        finally:
            self._depth -= 1
            self.segments += 1
            if outermost:
                self.seconds += time.perf_counter() - t0
            if counter is not None:
                self.flops += counter.get_total_flops()


@contextlib.contextmanager
def _frozen_batchnorm(modules: list[nn.modules.batchnorm._BatchNorm]) -> Iterator[None]:
    """Batch statistics without running-stat updates: what a recomputed forward must do.

    Momentum 0 makes the kernel's update `r = (1 - 0) * r + 0 * batch`, which leaves `r` as it
    is while saving the same tensors as the original forward (checkpoint checks that count);
    `num_batches_tracked` is put back afterwards.
    """
    saved = [(m.momentum, None if m.num_batches_tracked is None else
              int(m.num_batches_tracked)) for m in modules]
    try:
        for m in modules:
            m.momentum = 0.0
        yield
    finally:
        for m, (momentum, tracked) in zip(modules, saved, strict=True):
            m.momentum = momentum
            if tracked is not None:
                m.num_batches_tracked.fill_(tracked)


class RematChain(nn.Module):
    """Runs a chain of blocks under a plan. Shares the blocks (and parameters) it is given."""

    def __init__(self, blocks: list[nn.Module], plan: Plan) -> None:
        super().__init__()
        if plan.n_blocks != len(blocks):
            raise ConfigError(f"plan is for {plan.n_blocks} blocks, the chain has {len(blocks)}")
        self.blocks = nn.ModuleList(blocks)
        self.plan = plan
        self.recompute = RecomputeStats()
        self.hooks: list[Callable[[torch.Tensor], None]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(self.plan.items, x)

    def _run(self, items: tuple[Item, ...], x: torch.Tensor) -> torch.Tensor:
        for item in items:
            if isinstance(item, int):
                x = self.blocks[item](x)
            elif torch.is_grad_enabled():
                for hook in self.hooks:
                    hook(x)  # the segment's input stays alive for backward
                x = self._checkpoint(item, x)
            else:
                x = self._run(item.inner, x)
        return x

    def _checkpoint(self, seg: Segment, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # Under torch.compile the segment becomes a tagged recompute region of the graph:
            # the partitioner recomputes it in backward, and functionalisation makes BatchNorm's
            # running-stat updates happen once, in forward. Dynamo rejects custom context_fn.
            return checkpoint(self._segment_fn(seg), x, use_reentrant=False)
        return checkpoint(self._segment_fn(seg), x, use_reentrant=False,
                          context_fn=self._contexts(seg))

    def _segment_fn(self, seg: Segment) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: self._run(seg.inner, x)

    def _contexts(self, seg: Segment) -> Callable[[], tuple]:
        bns = [m for b in self.blocks[seg.start:seg.end] for m in b.modules()
               if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]

        @contextlib.contextmanager
        def recompute_context() -> Iterator[None]:
            # entered only when backward recomputes the segment, not when it is created
            with self.recompute.region(), _frozen_batchnorm(bns):
                yield

        return lambda: (contextlib.nullcontext(), recompute_context())


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The chain of blocks of a model: an `nn.Sequential`'s children, a `RematChain`'s blocks,
    or, for any other module, the chain found by tracing (see `rematlab.chain`)."""
    if isinstance(model, RematChain):
        return list(model.blocks)
    if isinstance(model, nn.Sequential):
        return list(model)
    from rematlab.chain import trace_blocks

    return trace_blocks(model)


def apply(
    model: nn.Module,
    strategy: str | Strategy | Plan,
    *,
    blocks: list[nn.Module] | None = None,
    example_input: torch.Tensor | None = None,
) -> RematChain:
    """Return `model` rematerialized under `strategy`, sharing its parameters.

    `blocks` overrides how the chain is found. `selective` needs per-block costs, which are
    profiled on the meta device from `example_input` (no real compute, no memory).
    """
    chain = blocks if blocks is not None else blocks_of(model)
    if isinstance(strategy, Plan):
        return RematChain(chain, strategy)
    strat = parse(strategy) if isinstance(strategy, str) else strategy
    costs = None
    if strat.needs_costs:
        if example_input is None:
            raise ConfigError("strategy 'selective' needs an example input to profile blocks")
        from rematlab.chain import profile_chain

        costs = profile_chain(chain, example_input, device=torch.device("meta"))
    return RematChain(chain, strat.build(len(chain), costs))
