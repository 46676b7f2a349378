"""How rematlab drives a model: as a chain it runs itself, or as layers the model runs.

A *chain* (`nn.Sequential`, blocks given as modules, or a model `torch.fx` cuts into
single-tensor blocks) is run block by block by `strategies.RematChain`, so any plan — nested
segments of several blocks — can be executed. Any other model (several inputs, dict batches,
Hugging Face outputs, untraceable code) is driven through its *layers*
(`rematlab.remat.layers`): the model runs its own loop and rematlab checkpoints single layers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from rematlab.exceptions import ConfigError
from rematlab.plans.plan import Plan, Selective, Shapes
from rematlab.remat.activations import checked_modules
from rematlab.remat.find import find_layers
from rematlab.remat.tracing import find_chain


def block_shapes(block: nn.Module) -> Shapes:
    """`block`'s parameters by name and size: what a plan records of each block it was made
    for, so that a plan made for another model of the same depth is refused, not applied
    under a budget that no longer holds (FSDP2's sharded parameters report full sizes)."""
    return tuple((name, tuple(p.shape)) for name, p in block.named_parameters())


def check_fits(plan: Plan, blocks: list[nn.Module], kind: str, first: int) -> None:
    """Refuse `plan` for `blocks` (plan block `first` is `blocks[0]`, each named `kind` and
    its index) when it was made for another model (`check_shapes`) or a module-level option
    was edited (`activations.checked_modules`): once, when it is applied, before any step."""
    check_shapes(plan.shapes, blocks, kind)
    for it in plan.items:
        if isinstance(it, Selective) and it.modules:
            where = it.block - first
            checked_modules(blocks[where], it.modules, f"{kind} {where}")


def check_shapes(made_for: tuple[Shapes, ...] | None, blocks: list[nn.Module], kind: str
                 ) -> None:
    """Refuse a plan whose recorded `made_for` shapes differ from `blocks` (each named
    `kind` and its index), saying where and what differs; a plan without shapes passes."""
    if made_for is None:
        return
    if len(made_for) != len(blocks):
        raise ConfigError(f"the plan was made for {len(made_for)} {kind}s, the model has "
                          f"{len(blocks)}; plan again")
    for i, (want, block) in enumerate(zip(made_for, blocks, strict=True)):
        has = block_shapes(block)
        if has == want:
            continue
        was, now = dict(want), dict(has)
        name = next((n for n in [*was, *now] if was.get(n) != now.get(n)), "")

        def size(dims: tuple[int, ...] | None) -> str:
            return "absent" if dims is None else "×".join(map(str, dims)) or "scalar"
        raise ConfigError(f"the plan was made for another model: {kind} {i}'s {name} is "
                          f"{size(now.get(name))}, the plan's was {size(was.get(name))}; "
                          "plan again for this model")


@dataclass(frozen=True)
class Structure:
    """The blocks of a model and how they run: `kind` is "chain" or "layers"; `how` says how
    they were found (sequential, given, fx, named, repeated)."""

    kind: str
    blocks: list[nn.Module]
    how: str
    names: list[str] = field(default_factory=list)

    @property
    def n_blocks(self) -> int:
        """Blocks of the plan: the chain's, or the layers plus one before and one after."""
        return len(self.blocks) + (2 if self.kind == "layers" else 0)

    def describe(self) -> str:
        if self.kind == "chain":
            return f"chain of {len(self.blocks)} blocks ({self.how})"
        return (f"{len(self.blocks)} layers ({self.how}: {self.stacks()}) run by the model's "
                "own loop; single layers checkpointed")

    def stacks(self) -> str:
        """Each stack the layers come from, with how many layers it gives: "model.encoder.layers
        x3, model.decoder.layers x3" (a layer's stack is the module that holds it)."""
        counts: dict[str, int] = {}
        for name in self.names:
            stack = name.rpartition(".")[0] or name
            counts[stack] = counts.get(stack, 0) + 1
        return ", ".join(f"{stack} x{n}" for stack, n in counts.items()) or "unnamed"


def structure(model: nn.Module, example: object = None,
              blocks: list[nn.Module] | str | list[str] | None = None) -> Structure:
    """See the module docstring. `blocks`: modules (a chain rematlab runs) or names of the
    model's layers (`"transformer.h"`)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"expected an nn.Module, got {type(model).__name__}")
    if blocks is not None and not isinstance(blocks, str) and all(
            isinstance(b, nn.Module) for b in blocks):
        return Structure("chain", list(blocks), "given")
    if blocks is not None:
        named = find_layers(model, blocks)
        return Structure("layers", [m for _, m in named], "named", [n for n, _ in named])
    if isinstance(model, nn.Sequential):
        return Structure("chain", list(model), "sequential")
    if example is None or isinstance(example, torch.Tensor):
        with contextlib.suppress(ConfigError):
            info = find_chain(model, example, quiet=True)
            stacks = _stacks_inside(model, info.blocks)
            if stacks:
                named = find_layers(model, stacks)
                return Structure("layers", [m for _, m in named],
                                 f"inside an {info.method} block", [n for n, _ in named])
            if len(info.blocks) > 1:
                return Structure("chain", info.blocks, info.method)
    named = find_layers(model)
    return Structure("layers", [m for _, m in named], "repeated", [n for n, _ in named])


def _stacks_inside(model: nn.Module, blocks: list[nn.Module]) -> list[str]:
    """Names of the layer stacks (a `ModuleList`/`Sequential` of two or more modules of one
    class) that sit whole inside one block of a chain. fx keeps torch.nn's own containers
    (`nn.TransformerEncoder`) as leaves, so a chain can hold a whole encoder in one block and
    have nothing to checkpoint: such a model is driven through the stack's layers instead."""
    names = {id(m): n for n, m in model.named_modules()}
    found: list[str] = []
    for block in blocks:
        for m in block.modules():
            name = names.get(id(m))
            if name is None or not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) < 2:
                continue
            if len({type(c) for c in m.children()}) == 1 and not any(
                    name.startswith(f"{f}.") for f in found):
                found.append(name)
    return found
