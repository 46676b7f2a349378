"""Plans as plain data: which blocks of a chain are checkpointed, nested, and what it costs.

A plan is a sequence of *items* over the blocks `0..n-1` of a chain. An item is either a
block index (run it and keep what its backward needs) or a `Segment` (run blocks
`start..end-1` keeping only the segment's input; recompute them during backward following
the segment's own `inner` items, which may hold further segments: multi-level checkpointing).

This module imports no torch: plans are serialised as JSON and their peak memory and time are
simulated over per-block cost arrays (`ChainCosts`; `rematlab.plans.simulate`), the same model
the solver optimises.

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
    for backward, every other op is recomputed during backward; or (`modules`) the block
    runs as it is but those submodules of it (names relative to the block: an activation
    function) are checkpointed, each keeping its input and running again in backward. Its
    memory and times are measured like a plain block's (`ChainCosts`); `sequence` is a hash
    of the block's op sequence, so a plan made for other code is refused
    (`rematlab.remat.ops`). An option named "offload" (`rematlab.plans.offload`) runs the
    block kept with `host` of its saved bytes in host memory until its backward; its times
    take its reload as prefetched by the next block, and `unprefetched` is what the reload
    costs more when the next block is not offloaded."""

    name: str
    saves: tuple[tuple[str, int], ...]
    saved: int
    keeps_input: bool
    keeps_output: bool
    fwd_mem: int
    bwd_mem: int
    fwd_time: float
    bwd_time: float
    sequence: str = ""
    modules: tuple[str, ...] = ()
    host: int = 0
    unprefetched: float = 0.0


@dataclass(frozen=True)
class Selective:
    """Run `block` kept under the option named `option` (`Option`'s fields; the plan carries
    them all, so it applies without its costs)."""

    block: int
    option: str
    saves: tuple[tuple[str, int], ...] = ()
    sequence: str = ""
    modules: tuple[str, ...] = ()

    @classmethod
    def of(cls, block: int, opt: Option) -> Selective:
        return cls(block, opt.name, opt.saves, opt.sequence, opt.modules)


OFFLOAD = "offload"  # the options that offload instead of recomputing (`plans.offload`)
OFFLOAD_INPUT = "offload input"  # checkpointed, its input offloaded (transformers' offload)


def offloads(option: str) -> bool:
    """Whether an option offloads: "offload", "offload N" (up to N bytes), "offload input"."""
    return option == OFFLOAD or option.startswith(OFFLOAD + " ")


def offload_cap(option: str) -> int | None:
    """The bytes an offload option moves at most (None: all); a name the planner does not
    write is refused."""
    text = option.removeprefix(OFFLOAD + " ")
    if option not in (OFFLOAD, OFFLOAD_INPUT) and not text.isdigit():
        raise ConfigError(f"option {option!r} is not an offload option: 'offload' or "
                          "'offload <bytes>'")
    return int(text) if text.isdigit() else None


Item = Union[int, Selective, Segment]  # noqa: UP007 - recursive alias needs the runtime form
Shapes = tuple[tuple[str, tuple[int, ...]], ...]  # a block's parameters: (name, sizes)


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
    # the seconds a checkpointed segment starting at each block costs beyond recomputing its
    # forward (checkpoint's host work: hooks, the RNG state; on a GPU what of it the
    # recomputation's kernels do not hide, `preflight.pricing.checkpoint_seconds`), with its
    # range; none when measured (a measured segment's time is its own)
    fwd_range: list[tuple[float, float]] = field(default_factory=list)
    bwd_range: list[tuple[float, float]] = field(default_factory=list)
    checkpoint_time: list[float] = field(default_factory=list)
    checkpoint_range: list[tuple[float, float]] = field(default_factory=list)
    # the user's step (`rematlab.core.recipe.Step`): `cast[i]` the bytes of block i's
    # low-precision weight copies that autocast caches until the forward ends (held by a
    # checkpointed block beyond its input; a kept block saves them anyway); with
    # `grads_resident` every gradient is alive all step (accumulation, `set_to_none=False`),
    # counted in `base`, so none appears during backward
    cast: list[int] = field(default_factory=list)
    grads_resident: bool = False

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
                       bwd_time=[r[end] for r in self.bwd_range],
                       checkpoint_time=[r[end] for r in self.checkpoint_range])

    def checkpoint_cost(self, start: int) -> float:
        """Seconds a checkpointed segment starting at block `start` adds beyond its
        recomputed forward (0 where not predicted)."""
        return self.checkpoint_time[start] if self.checkpoint_time else 0.0

    def grads_between(self, start: int, end: int) -> int:
        """Gradient bytes that backward creates for blocks `start..end-1` (none when they
        are resident, already in `base`)."""
        return 0 if self.grads_resident else sum(self.grad[start:end])

    def cached(self, start: int, end: int) -> int:
        """Autocast's cached weight copies of blocks `start..end-1`."""
        return sum(self.cast[start:end]) if self.cast else 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ChainCosts:
        menus = [[Option(**{**{k: v for k, v in o.items() if k != "ops"},  # "ops": older
                            "sequence": o.get("sequence", o.get("ops", "")),
                            "saves": tuple(tuple(v) for v in o["saves"]),
                            "modules": tuple(o.get("modules", ()))}) for o in menu]
                 for menu in data.get("options", [])]
        ckpt = data.get("checkpoint_time", [])
        if isinstance(ckpt, (int, float)):  # written before the cost was per block
            ckpt = [float(ckpt)] * len(data["saved"]) if ckpt else []
        return cls(**{**data, "options": menus, "checkpoint_time": ckpt})


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
    # on a predicted GPU target, the card's reserved peak: the whole step replayed through
    # the caching allocator (`rematlab.planning.reserve`)
    reserved_peak: int | None = None
    compiled: bool = False  # costs and peak are for running it under torch.compile
    step: dict | None = None  # the user's step it was made for (`rematlab.Step.to_dict`)
    # compiled: torch.compile's activation memory budget for the planned forward's graph
    # (None: the partitioner's own), and the settings its peak was measured under
    # (`rematlab.remat.compiled_budget`), which `apply` insists on
    fraction: float | None = None
    compile_settings: dict | None = None
    # the parameter shapes of each block it was made for (`remat.structure.block_shapes`:
    # a chain's blocks, or a model's layers), which `apply` checks; None in older plans
    shapes: tuple[Shapes, ...] | None = None

    def __post_init__(self) -> None:
        validate_items(self.items, 0, self.n_blocks)

    @property
    def segments(self) -> list[Segment]:
        """Top-level checkpointed segments."""
        return [it for it in self.items if isinstance(it, Segment)]

    @property
    def recomputed(self) -> int:
        """Blocks recomputing: top-level segments' and options' (offloaded: "offload input")."""
        return sum(it.end - it.start if isinstance(it, Segment) else 1 for it in self.items
                   if isinstance(it, Segment) or (isinstance(it, Selective)
                   and (not offloads(it.option) or it.option == OFFLOAD_INPUT)))

    @property
    def offloaded(self) -> list[int]:
        """The blocks whose saved activations wait in host memory (`plans.offload`)."""
        return [it.block for it in self.items
                if isinstance(it, Selective) and offloads(it.option)]

    def describe(self) -> str:
        """Compact text form: `[0-3]{0,1,[2-3]} 4 5` (brackets are checkpointed segments),
        then torch.compile's memory budget if the plan sets one (`@ fraction 0.5`)."""
        text = " ".join(_describe(it) for it in self.items)
        return text if self.fraction is None else f"{text} @ fraction {self.fraction:g}"

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
                "reserved_peak": self.reserved_peak,
                "compiled": self.compiled,
                "step": self.step,
                "fraction": self.fraction,
                "compile_settings": self.compile_settings,
                "shapes": (None if self.shapes is None else
                           [{name: list(dims) for name, dims in block} for block in self.shapes]),
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
                reserved_peak=data.get("reserved_peak"),
                compiled=bool(data.get("compiled", False)),
                step=data.get("step") if isinstance(data.get("step"), dict) else None,
                fraction=(None if data.get("fraction") is None
                          else checked_fraction(data["fraction"])),
                compile_settings=(data.get("compile_settings")
                                  if isinstance(data.get("compile_settings"), dict) else None),
                shapes=_shapes_from_json(data.get("shapes")),
            )
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError,
                json.JSONDecodeError) as exc:
            raise ConfigError(f"not a rematlab plan: {type(exc).__name__}: "
                              f"{str(exc)[:200]}") from None


def checked_fraction(value: object) -> float:
    """A plan's torch.compile memory budget, refused unless in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"fraction {value!r} is not a memory budget in [0, 1]")
    return float(value)


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
                "saves": [list(op) for op in item.saves], "sequence": item.sequence,
                "modules": list(item.modules)}
    return {"checkpoint": [item.start, item.end], "inner": [_item_to_json(i) for i in item.inner]}


def _item_from_json(data: int | dict, depth: int = 0) -> Item:
    if depth > _MAX_DEPTH:
        raise ValueError(f"segments nested deeper than {_MAX_DEPTH}")
    if isinstance(data, bool) or not isinstance(data, (int, dict)):
        raise TypeError(f"a plan item is a block index or a segment, got {data!r}"[:120])
    if isinstance(data, int):
        return data
    if "option" in data:
        sequence = data.get("sequence", data.get("ops", ""))  # "ops" in older plans
        if not isinstance(data["option"], str) or not isinstance(sequence, str):
            raise TypeError("an option and its op sequence's hash are strings")
        saves = tuple((str(name), int(k)) for name, k in data.get("saves", []))
        modules = data.get("modules", [])
        if not isinstance(modules, list) or not all(isinstance(m, str) and m for m in modules):
            raise TypeError("an option's modules are submodule names")
        return Selective(int(data["block"]), data["option"], saves, sequence, tuple(modules))
    start, end = data["checkpoint"]
    return Segment(int(start), int(end), tuple(_item_from_json(i, depth + 1)
                                               for i in data["inner"]))


def _shapes_from_json(data: object) -> tuple[Shapes, ...] | None:
    if data is None:
        return None
    if not isinstance(data, list) or not all(isinstance(b, dict) for b in data):
        raise TypeError("a plan's shapes are a list of {parameter: [sizes]} per block")
    return tuple(tuple((str(name), tuple(int(d) for d in dims)) for name, dims in block.items())
                 for block in data)


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
