"""Plans as plain data: which blocks of a chain are checkpointed, nested, and what it costs.

A plan is a sequence of *items* over the blocks `0..n-1` of a chain. An item is either a
block index (run it and keep what its backward needs) or a `Segment` (run blocks
`start..end-1` keeping only the segment's input; recompute them during backward following
the segment's own `inner` items, which may hold further segments: multi-level checkpointing).

This module imports no torch: plans are serialised as JSON and their peak memory and time are
simulated over per-block cost arrays (`ChainCosts`), the same model the solver optimises.

Design note — the memory model. Memory is accounted relative to a baseline (parameters,
optimizer state, the input batch, the loss gradient). A block run plainly *holds* its saved
tensors until its backward; the tensor at a boundary between blocks is counted once, whether
the block before saves it as output, the block after saves it as input, or a checkpointed
segment keeps it as its input. Gradients of parameters appear block by block during backward
(optimizer.zero_grad(set_to_none=True) frees them before the next forward), so the backward of
block i also holds the gradients of every later block.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Union

from rematlab.exceptions import ConfigError


@dataclass(frozen=True)
class Segment:
    """Checkpoint blocks `start..end-1`; recompute them during backward following `inner`."""

    start: int
    end: int
    inner: tuple[Item, ...]


@dataclass(frozen=True)
class Option:
    """A way to run block i kept but holding less (an op-level plan): only the outputs of
    the ops in `saves` — (aten op name, occurrence within the block's forward) — are kept
    for backward, every other op is recomputed during backward. Its memory and times are
    measured like a plain block's (`ChainCosts`); `ops` fingerprints the block's op sequence,
    so a plan made for other code is refused (`rematlab.remat.ops`)."""

    name: str
    saves: tuple[tuple[str, int], ...]
    saved: int
    keeps_input: bool
    keeps_output: bool
    fwd_mem: int
    bwd_mem: int
    fwd_time: float
    bwd_time: float
    ops: str = ""


@dataclass(frozen=True)
class Selective:
    """Run `block` kept under the option named `option`: save the outputs of the ops in
    `saves`, recompute the rest in backward; `ops` fingerprints the op sequence the option
    was made for (the plan carries both, so it applies without its costs)."""

    block: int
    option: str
    saves: tuple[tuple[str, int], ...] = ()
    ops: str = ""

    @classmethod
    def of(cls, block: int, opt: Option) -> Selective:
        return cls(block, opt.name, opt.saves, opt.ops)


Item = Union[int, Selective, Segment]  # noqa: UP007 - recursive alias needs the runtime form


@dataclass
class ChainCosts:
    """Per-block costs of one chain at one batch size, dtype and device (bytes and seconds).

    `x[i]` is the size of the tensor entering block i (`x[n]` the chain's output); `saved[i]`
    the bytes block i saves for backward other than parameters, its input and its output;
    `keeps_input`/`keeps_output` whether those boundary tensors are among the saved ones;
    `fwd_mem[i]` / `bwd_mem[i]` the transient peak of block i's forward / backward above the
    memory live just before it; `rec_mem[i]` that of its forward when it ends a recomputed
    segment (torch stops recomputing at the last tensor the segment saved; empty: as
    `fwd_mem`); `grad[i]` the parameter-gradient bytes of block i; `loss_mem` the loss's peak
    at the end of the forward, above `base`.
    """

    x: list[int]
    saved: list[int]
    keeps_input: list[bool]
    keeps_output: list[bool]
    fwd_mem: list[int]
    bwd_mem: list[int]
    grad: list[int]
    fwd_time: list[float]
    bwd_time: list[float]
    fwd_flops: list[float] = field(default_factory=list)
    rec_mem: list[int] = field(default_factory=list)
    base: int = 0  # parameters + optimizer state + input batch + output + its gradient
    loss_mem: int = 0
    state: int = 0  # optimizer state (part of base)
    optimizer_peak: int = 0  # params + all grads + optimizer state + step transient
    options: list[list[Option]] = field(default_factory=list)  # per block; [] = keep or not
    # predicted costs (`rematlab.preflight`): each block's (fastest, slowest) seconds, and
    # the seconds each checkpointed segment costs beyond recomputing its forward (hooks, the
    # RNG state, a forward run again on a cold cache), calibrated on the target; 0 measured
    fwd_range: list[tuple[float, float]] = field(default_factory=list)
    bwd_range: list[tuple[float, float]] = field(default_factory=list)
    checkpoint_time: float = 0.0

    @property
    def n(self) -> int:
        return len(self.saved)

    def menu(self, block: int) -> list[Option]:
        """Block `block`'s op-level options besides keeping it whole (none when unprofiled)."""
        return self.options[block] if block < len(self.options) else []

    def option(self, block: int, name: str) -> Option:
        for opt in self.menu(block):
            if opt.name == name:
                return opt
        raise ConfigError(f"block {block} has no option {name!r} in these costs "
                          f"(it has: {[o.name for o in self.menu(block)] or 'none'})")

    def bound(self, end: int) -> ChainCosts:
        """These costs with every block's times at one end of their predicted interval (0:
        fastest, 1: slowest), so that a plan's time can be given as an interval; the same
        costs when the times were measured."""
        if not self.fwd_range:
            return self
        return replace(self, fwd_time=[r[end] for r in self.fwd_range],
                       bwd_time=[r[end] for r in self.bwd_range])

    def grads_between(self, start: int, end: int) -> int:
        return sum(self.grad[start:end])

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ChainCosts:
        menus = [[Option(**{**o, "saves": tuple(tuple(v) for v in o["saves"])}) for o in menu]
                 for menu in data.get("options", [])]
        return cls(**{**data, "options": menus})


@dataclass(frozen=True)
class Plan:
    """A checkpointing plan for an `n_blocks` chain, with its simulated cost when known."""

    n_blocks: int
    items: tuple[Item, ...]
    name: str = "plan"
    predicted_peak: int | None = None
    predicted_time: float | None = None
    budget: int | None = None
    min_peak: int | None = None
    measured_peak: int | None = None
    compiled: bool = False  # costs and peak are for running it under torch.compile

    def __post_init__(self) -> None:
        validate_items(self.items, 0, self.n_blocks)

    @property
    def segments(self) -> list[Segment]:
        """Top-level checkpointed segments."""
        return [it for it in self.items if isinstance(it, Segment)]

    def describe(self) -> str:
        """Compact text form: `[0-3]{0,1,[2-3]} 4 5` (brackets are checkpointed segments)."""
        return " ".join(_describe(it) for it in self.items)

    def to_json(self) -> str:
        return json.dumps(
            {
                "n_blocks": self.n_blocks,
                "name": self.name,
                "items": [_item_to_json(it) for it in self.items],
                "predicted_peak": self.predicted_peak,
                "predicted_time": self.predicted_time,
                "budget": self.budget,
                "min_peak": self.min_peak,
                "measured_peak": self.measured_peak,
                "compiled": self.compiled,
            },
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        def refuse(constant: str) -> None:
            raise ValueError(f"{constant} is not a number a plan holds")

        try:
            data = json.loads(text, parse_constant=refuse)
            if not isinstance(data, dict):
                raise TypeError("a plan is a JSON object")
            items = tuple(_item_from_json(it) for it in data["items"])
            return cls(
                n_blocks=int(data["n_blocks"]),
                items=items,
                name=data.get("name", "plan"),
                predicted_peak=data.get("predicted_peak"),
                predicted_time=data.get("predicted_time"),
                budget=data.get("budget"),
                min_peak=data.get("min_peak"),
                measured_peak=data.get("measured_peak"),
                compiled=bool(data.get("compiled", False)),
            )
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError,
                json.JSONDecodeError) as exc:
            raise ConfigError(f"not a rematlab plan: {type(exc).__name__}: "
                              f"{str(exc)[:200]}") from None


def _describe(item: Item) -> str:
    if isinstance(item, int):
        return str(item)
    if isinstance(item, Selective):
        return f"{item.block}{{{item.option}}}"
    inner = ",".join(_describe(i) for i in item.inner)
    return f"[{item.start}-{item.end - 1}]{{{inner}}}"


def _item_to_json(item: Item) -> int | dict:
    if isinstance(item, int):
        return item
    if isinstance(item, Selective):
        return {"block": item.block, "option": item.option,
                "saves": [list(op) for op in item.saves], "ops": item.ops}
    return {"checkpoint": [item.start, item.end], "inner": [_item_to_json(i) for i in item.inner]}


def _item_from_json(data: int | dict, depth: int = 0) -> Item:
    if depth > _MAX_DEPTH:
        raise ValueError(f"segments nested deeper than {_MAX_DEPTH}")
    if isinstance(data, bool) or not isinstance(data, (int, dict)):
        raise TypeError(f"a plan item is a block index or a segment, got {data!r}"[:120])
    if isinstance(data, int):
        return data
    if "option" in data:
        if not isinstance(data["option"], str) or not isinstance(data.get("ops", ""), str):
            raise TypeError("an option and its op fingerprint are strings")
        saves = tuple((str(name), int(k)) for name, k in data.get("saves", []))
        return Selective(int(data["block"]), data["option"], saves, data.get("ops", ""))
    start, end = data["checkpoint"]
    return Segment(int(start), int(end), tuple(_item_from_json(i, depth + 1)
                                               for i in data["inner"]))


_MAX_DEPTH = 64  # a chain of n blocks nests at most n deep; deeper JSON is not a plan


def validate_items(items: tuple[Item, ...], start: int, end: int, inside: bool = False
                   ) -> None:
    """Items must cover `start..end-1` in order, each block once; segments likewise inside,
    where no block runs under an op-level option (its selective cache, made in the segment's
    first forward, would live until backward beside the recomputation's)."""
    pos = start
    for item in items:
        if isinstance(item, Selective) and inside:
            raise ConfigError(f"block {item.block} runs an op-level option inside a "
                              "checkpointed segment; options apply to blocks kept at the top "
                              "level")
        if isinstance(item, (int, Selective)):
            block = item if isinstance(item, int) else item.block
            if block != pos:
                raise ConfigError(f"plan expects block {pos} next, found block {block}")
            pos += 1
        else:
            if item.start != pos or item.end <= item.start:
                raise ConfigError(
                    f"plan segment [{item.start}, {item.end}) does not start at {pos}")
            validate_items(item.inner, item.start, item.end, inside=True)
            pos = item.end
    if pos != end:
        raise ConfigError(f"plan covers blocks up to {pos - 1}, expected up to {end - 1}")


# --- simulation ----------------------------------------------------------------------------------


def need(items: tuple[Item, ...], end: int, held_in: bool, c: ChainCosts) -> tuple[int, float]:
    """Memory (above the baseline, with the gradient of `x[end]` counted in it) and time that
    the items need to run forward and backward over `..end-1`; `held_in` says whether the input
    of the first item is already held by someone else."""
    if not items:
        return 0, 0.0
    first, rest = items[0], items[1:]
    if isinstance(first, (int, Selective)):
        s, opt = kept(first, c)
        held, fwd, bwd = keep_terms(c, s, end, held_in, opt)
        m_rest, t_rest = need(rest, end, opt.keeps_output if opt else c.keeps_output[s], c)
        step = opt.fwd_time + opt.bwd_time if opt else c.fwd_time[s] + c.bwd_time[s]
        return max(fwd, held + m_rest, bwd), step + t_rest
    s, k = first.start, first.end
    held, fwd, recompute_base = checkpoint_terms(c, s, k, end, held_in)
    m_rest, t_rest = need(rest, end, False, c)
    m_in, t_in = need(first.inner, k, True, c)
    mem = max(fwd, held + m_rest, recompute_base + m_in)
    return mem, sum(c.fwd_time[s:k]) + c.checkpoint_time + t_rest + t_in


def kept(item: int | Selective, c: ChainCosts) -> tuple[int, Option | None]:
    """A kept item's block and its option (None: the block run plainly)."""
    if isinstance(item, int):
        return item, None
    return item.block, c.option(item.block, item.option)


def keep_terms(c: ChainCosts, s: int, end: int, held_in: bool, opt: Option | None = None
               ) -> tuple[int, int, int]:
    """Block s run kept (plainly, or under option `opt`), with `..end` to backpropagate:
    what it holds until its backward, its forward peak and its backward peak (relative, as
    in `need`). The one place these formulas live: the simulator (`need`) and the solver
    both call it."""
    saved, ki, ko, fwd_mem, bwd_mem = ((opt.saved, opt.keeps_input, opt.keeps_output,
                                        opt.fwd_mem, opt.bwd_mem) if opt else
                                       (c.saved[s], c.keeps_input[s], c.keeps_output[s],
                                        c.fwd_mem[s], c.bwd_mem[s]))
    if end == s + 1 < c.n and not opt and c.rec_mem:  # it ends a recomputed segment
        fwd_mem = c.rec_mem[s]
    held = saved + (c.x[s] if ki and not held_in else 0) + (c.x[s + 1] if ko else 0)
    fwd = (0 if held_in else c.x[s]) + fwd_mem
    if s == c.n - 1:  # the chain's last block is always kept: the loss runs after it
        fwd = max(fwd, held + c.loss_mem)
    bwd = held + c.x[s + 1] - c.x[end] + c.grads_between(s + 1, end) + bwd_mem
    return held, fwd, bwd


def checkpoint_terms(c: ChainCosts, s: int, k: int, end: int, held_in: bool
                     ) -> tuple[int, int, int]:
    """Segment [s, k) checkpointed, with `..end` to backpropagate: what it holds (its input),
    the peak of its forward run without saving, and the memory already live when backward
    recomputes it (its input, the output gradient, the gradients of later blocks)."""
    held = 0 if held_in else c.x[s]
    fwd = held + max(c.fwd_mem[i] + (c.x[i] if i > s else 0) for i in range(s, k))
    recompute_base = held + c.x[k] - c.x[end] + c.grads_between(k, end)
    return held, fwd, recompute_base


def held_bytes(plan: Plan, c: ChainCosts) -> int:
    """What a plan holds for backward when its forward ends: kept blocks' saved tensors and
    boundaries, checkpointed segments' inputs (the terms of `need`)."""
    total, held_in = 0, True
    for item in plan.items:
        if isinstance(item, (int, Selective)):
            s, opt = kept(item, c)
            total += keep_terms(c, s, c.n, held_in, opt)[0]
            held_in = opt.keeps_output if opt else c.keeps_output[s]
        else:
            total += checkpoint_terms(c, item.start, item.end, c.n, held_in)[0]
            held_in = False
    return total


def simulate(plan: Plan, costs: ChainCosts) -> tuple[int, float]:
    """Peak bytes of the whole training step and its time (seconds) under `plan`."""
    if plan.n_blocks != costs.n:
        raise ConfigError(f"plan is for {plan.n_blocks} blocks, the chain has {costs.n}")
    mem, time = need(plan.items, costs.n, True, costs)
    return step_peak(costs, mem), time


def step_peak(costs: ChainCosts, mem: int) -> int:
    """The whole step's peak for a plan whose forward+backward needs `mem` bytes above the
    baseline: the larger of that and the optimizer step's own peak."""
    return max(costs.base + mem, costs.optimizer_peak)


def overhead(time: float, none_time: float) -> float:
    """Time overhead of a plan against keeping every activation: `time / none - 1`."""
    return time / none_time - 1.0 if none_time > 0 else 0.0
