"""Finding the layers a model runs in its own loop: the ones the user names, or the
repeated ones the ecosystem's tools pick (`transformer.h`, `encoder.layer`, `stages.*.blocks`).
Choosing by class or by name, never by tracing alone, as torch's
`apply_activation_checkpointing(check_fn=...)` and transformers do.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from torch import nn

from rematlab.exceptions import ConfigError


def find_layers(model: nn.Module, names: str | list[str] | None = None
                ) -> list[tuple[str, nn.Module]]:
    """The layers to checkpoint, as (qualified name, module) in model order.

    `names`: submodule names; a `ModuleList`/`Sequential` stands for its children (`"transformer.h"`
    -> every GPT-2 block). Without names, every stack of the model, as the ecosystem finds them:
    on transformers models the layers it marks as checkpointable (`GradientCheckpointingLayer`:
    the encoder's and the decoder's, a vision tower's and a language model's). Elsewhere the
    layers of every stack (`_stacked`), each not nested in another one; failing those, the
    class of module repeated (twice or more) inside a `ModuleList`/`Sequential` that holds the
    most parameters.
    """
    modules = dict(model.named_modules())
    if names:
        found: list[tuple[str, nn.Module]] = []
        listed = [n.strip() for n in names.split(",")] if isinstance(names, str) else names
        for name in [n for n in listed if n]:
            if name not in modules:
                stacks = ", ".join(_stack_names(model)[:5]) or "none found"
                raise ConfigError(f"{type(model).__name__} has no submodule {name!r}; layer "
                                  f"stacks in it: {stacks}")
            m = modules[name]
            if isinstance(m, (nn.ModuleList, nn.Sequential)):
                found.extend((f"{name}.{k}", c) for k, c in m.named_children())
            else:
                found.append((name, m))
        if len(found) < 1:
            raise ConfigError(f"no layers under {names!r}")
        for i, (a, _) in enumerate(found):
            for b, _ in found[i + 1:]:
                if a == b or b.startswith(f"{a}.") or a.startswith(f"{b}."):
                    raise ConfigError(f"the layers named overlap: {a!r} and {b!r}; name each "
                                      "layer (or its stack) once")
        return found
    marked = _outermost(model, lambda m: isinstance(m, _checkpointing_layer_class()))
    if marked:
        return marked
    containers = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]
    stacked = {id(c) for m in containers for c in _stacked(m)}
    if stacked:
        return _outermost(model, lambda m: id(m) in stacked)
    # no stack of composite layers (a `ModuleList` of plain `Linear`s): the repeated class
    # that holds the most parameters
    classes = {type(c) for m in containers for c in m.children()
               if not isinstance(c, (nn.ModuleList, nn.Sequential))
               and sum(type(o) is type(c) for o in m.children()) >= 2}
    if not classes:
        raise ConfigError(f"cannot find repeated layers in {type(model).__name__}: name them "
                          "with blocks=['path.to.layers'] (CLI: --blocks path.to.layers)")

    def size(cls: type) -> tuple[int, int]:
        layers = _outermost(model, lambda m: type(m) is cls)
        return sum(p.numel() for _, m in layers for p in m.parameters()), len(layers)

    primary = max(classes, key=lambda c: (size(c), c.__name__))
    return _outermost(model, lambda m: type(m) is primary)


def _stacked(container: nn.Module) -> list[nn.Module]:
    """The layers of a stack held in `container`: its children of a class it holds twice or
    more, each built of modules of its own and holding parameters (an encoder's layers, a
    decoder's, a vision tower's blocks; not the two `Linear`s of an MLP's `Sequential`)."""
    children = [c for c in container.children()
                if not isinstance(c, (nn.ModuleList, nn.Sequential))
                and any(True for _ in c.children()) and any(True for _ in c.parameters())]
    return [c for c in children if sum(type(o) is type(c) for o in children) >= 2]


def _checkpointing_layer_class() -> type | tuple[type, ...]:
    """transformers' own mark on every layer it can checkpoint (`GradientCheckpointingLayer`,
    transformers >= 4.52): its `gradient_checkpointing_enable()` checkpoints exactly these, in
    every stack of the model. Looked up only where transformers is already imported (a model
    of its classes is), so other models do not pay for importing it; else an empty tuple."""
    layers = sys.modules.get("transformers.modeling_layers")
    return getattr(layers, "GradientCheckpointingLayer", ())


def _outermost(model: nn.Module, chosen: Callable[[nn.Module], bool]
               ) -> list[tuple[str, nn.Module]]:
    """The chosen modules not nested in another chosen one, in model order (`named_modules`
    visits a module before what it holds)."""
    out: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if name and chosen(m) and not any(name.startswith(f"{o}.") for o, _ in out):
            out.append((name, m))
    return out


def _stack_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules()
            if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1 and n]
