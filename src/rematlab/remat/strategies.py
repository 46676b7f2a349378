"""Rematerialization strategies: parse them, turn them into plans, and run plans.

Every strategy — `none`, `uniform:N`, `every:K`, `selective[:T]`, `sqrt`, an explicit `Plan`
or `plan:FILE.json` — compiles to a `Plan` over the model's blocks (`rematlab.remat.structure`).
A chain runs under `RematChain`, which executes any plan, nested segments included; a model
that runs its own layer loop runs under `layers.LayerRemat`, which takes plans of single
layers. Both use non-reentrant `torch.utils.checkpoint` with the same recompute contexts. The
same strings work in Python, on the CLI and in grid files.

.. warning::
   Recomputation runs the forward of a segment a second time. Dropout masks are reproduced
   (the RNG state is saved and restored), and BatchNorm running statistics are *not* updated a
   second time: during recomputation every BatchNorm of the segment normalises with batch
   statistics, exactly as in the original training-mode forward, with its running buffers
   left as they are. Other modules with side effects in forward would repeat them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rematlab.exceptions import ConfigError
from rematlab.plans import fixed as plans
from rematlab.plans.plan import ChainCosts, Item, Plan, Segment, Selective
from rematlab.remat import compiled_budget
from rematlab.remat.chain import profile_chain
from rematlab.remat.layer_costs import profile_layers
from rematlab.remat.layers import LayerRemat, attach
from rematlab.remat.ops import run_option
from rematlab.remat.profiling import Profiling
from rematlab.remat.recompute import RecomputeStats, recompute_contexts
from rematlab.remat.structure import Structure, check_fits, structure

MAX_SEGMENTS = 1_000_000  # beyond any chain: a larger count is a typo
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

    def load(self) -> Plan:
        """The plan a `plan:FILE.json` strategy names; a `ConfigError` when it is missing or
        not a plan."""
        try:
            with open(str(self.path), encoding="utf-8") as fh:
                return Plan.from_json(fh.read())
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read plan file {self.path}: "
                              f"{exc.strerror if isinstance(exc, OSError) else exc}") from None

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
        loaded = self.load()
        if loaded.n_blocks != n:
            raise ConfigError(f"plan {self.path} is for {loaded.n_blocks} blocks, model has {n}")
        return loaded


def parse(text: str) -> Strategy:
    """Parse a strategy string; a `ConfigError` names the bad value and the allowed forms."""
    if not isinstance(text, str):
        raise ConfigError(f"a strategy is a string such as 'uniform:4', got {text!r}")
    m = _PATTERN.fullmatch(text.strip())
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
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"strategy {text!r}: the argument must be a positive, finite number")
    if value > MAX_SEGMENTS and kind != "selective":
        raise ConfigError(f"strategy {text!r}: at most {MAX_SEGMENTS} segments or blocks")
    return Strategy(kind, float(value))


class RematChain(nn.Module):
    """Runs a chain of blocks under a plan. Shares the blocks (and parameters) it is given."""

    def __init__(self, blocks: list[nn.Module], plan: Plan) -> None:
        super().__init__()
        if plan.n_blocks != len(blocks):
            raise ConfigError(f"plan is for {plan.n_blocks} blocks, the chain has {len(blocks)}")
        check_fits(plan, blocks, "block", first=0)
        if plan.offloaded:
            raise ConfigError(f"block(s) {plan.offloaded} offload: offload runs per layer of a "
                              "model that runs its own layer loop, not in a chain of blocks")
        self.blocks = nn.ModuleList(blocks)
        self.plan = plan
        self.recompute = RecomputeStats()
        self.hooks: list[Callable[[torch.Tensor], None]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return compiled_budget.budgeted(self.plan.fraction, self._run, self.plan.items, x)

    def _run(self, items: tuple[Item, ...], x: torch.Tensor) -> torch.Tensor:
        for item in items:
            if isinstance(item, int):
                x = self.blocks[item](x)
            elif isinstance(item, Selective):
                x = self._selective(item, x)
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

    def _selective(self, item: Selective, x: torch.Tensor) -> torch.Tensor:
        """Block `item.block` kept under its op-level option: its listed ops' outputs saved,
        the rest recomputed in backward (`rematlab.remat.ops`)."""
        block = self.blocks[item.block]
        if not torch.is_grad_enabled():
            return block(x)
        for hook in self.hooks:
            hook(x)  # the block's input stays alive for backward
        return run_option(item, block, block, self.recompute, f"block {item.block}", x)

    def _segment_fn(self, seg: Segment) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: self._run(seg.inner, x)

    def _contexts(self, seg: Segment) -> Callable[[], tuple]:
        return recompute_contexts(self.recompute, self.blocks[seg.start:seg.end])


def apply(
    model: nn.Module,
    strategy: str | Strategy | Plan,
    *,
    blocks: list[nn.Module] | str | list[str] | None = None,
    example_input: object = None,
) -> nn.Module:
    """Return `model` rematerialized under `strategy`, sharing its parameters.

    An `nn.Sequential` (or a list of modules in `blocks`) becomes a `RematChain`. Any other
    model comes back as itself — same class, attributes, methods and `state_dict` keys — a
    shallow copy whose forward runs the plan (`layers.attach`); the original is untouched.
    Traceable single-input models run as a chain of fx blocks; others through their repeated
    layers, or the layers named in `blocks` (`"transformer.h"`), one layer per checkpoint.
    `selective` needs per-block costs, profiled from `example_input` (on the meta device for
    a chain; on the input's device for layers).
    """
    if isinstance(model, RematChain):
        model, blocks = nn.Sequential(*model.blocks), None
    st = structure(model, example_input, blocks)
    strat = as_strategy(strategy)
    if isinstance(strat, Plan):  # a compiled plan holds under its measured settings only
        compiled_budget.check(strat.fraction, strat.compile_settings)
        if strat.compiled:
            compiled_budget.fresh_graphs()
    if st.kind == "layers":
        chosen = layer_plan(strat, st, model, example_input)
        return attach(model, LayerRemat(st.blocks, chosen))
    if isinstance(strat, Plan):
        chosen = strat
    else:
        costs = None
        if strat.needs_costs:
            if not isinstance(example_input, torch.Tensor):
                raise ConfigError("strategy 'selective' needs an example input to profile "
                                  "blocks")
            costs = profile_chain(st.blocks, example_input, device=torch.device("meta"))
        chosen = strat.build(st.n_blocks, costs)
    remat = RematChain(st.blocks, chosen)
    return remat if st.how in ("sequential", "given") else attach(model, remat)


def as_strategy(strategy: object) -> Strategy | Plan:
    """A strategy or plan from what `apply` was given: a `Plan`, a `Strategy`, a strategy's
    name ("every:2"), or a plan as a mapping (`json.loads(plan.to_json())`)."""
    if isinstance(strategy, (Plan, Strategy)):
        return strategy
    if isinstance(strategy, str):
        return parse(strategy)
    if isinstance(strategy, Mapping):
        try:
            return Plan.from_json(json.dumps(dict(strategy)))
        except (TypeError, ValueError, KeyError) as exc:
            raise ConfigError(f"not a plan: {type(exc).__name__}: {exc}"[:300]) from None
    raise ConfigError(f"a strategy is a name ('every:2'), a rematlab.Plan or a plan's JSON as a "
                      f"dict, got {type(strategy).__name__}")


def layer_plan(strat: Strategy | Plan, st: Structure, model: nn.Module, example: object
               ) -> Plan:
    """A per-layer plan: single layers checkpointed. `none`, `every:1` (every layer, as
    transformers' gradient checkpointing), `selective` (its picks, one layer each) and
    explicit plans apply; segments of several layers cannot run in the model's own loop."""
    n = st.n_blocks
    if isinstance(strat, Plan):
        return strat
    if strat.kind == "plan":
        return strat.build(n)
    if strat.kind == "none":
        return plans.none_plan(n)
    if strat.kind == "every" and strat.arg == 1:
        return plans.every_layer_plan(n)
    if strat.kind == "selective":
        if example is None:
            raise ConfigError("strategy 'selective' needs an example batch to profile layers")
        costs = profile_layers(model, example, st.blocks, Profiling(repeats=0))
        return plans.selective_per_layer(costs, 1.0 if strat.arg is None else strat.arg)
    raise ConfigError(f"strategy {strat} needs segments of several blocks, which "
                      f"{type(model).__name__}'s own layer loop cannot run; use none, every:1, "
                      "selective or an optimal plan (rematlab.plan)")
