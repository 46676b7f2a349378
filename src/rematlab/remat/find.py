"""Finding the layers a model runs in its own loop: the ones the user names, or the
repeated ones the ecosystem's tools pick (`transformer.h`, `encoder.layer`, `stages.*.blocks`).
Choosing by class or by name, never by tracing alone, as torch's
`apply_activation_checkpointing(check_fn=...)` and transformers do.
"""

from __future__ import annotations

from torch import nn

from rematlab.exceptions import ConfigError


def find_layers(model: nn.Module, names: str | list[str] | None = None
                ) -> list[tuple[str, nn.Module]]:
    """The layers to checkpoint, as (qualified name, module) in model order.

    `names`: submodule names; a `ModuleList`/`Sequential` stands for its children (`"transformer.h"`
    -> every GPT-2 block). Without names: the most common way the ecosystem finds them — the
    class of module repeated (twice or more) inside a `ModuleList`/`Sequential` that holds the
    most parameters, and every module of that class not nested in another one.
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
    classes = {type(c) for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))
               for c in m.children() if not isinstance(c, (nn.ModuleList, nn.Sequential))
               and sum(type(o) is type(c) for o in m.children()) >= 2}
    if not classes:
        raise ConfigError(f"cannot find repeated layers in {type(model).__name__}: name them "
                          "with blocks=['path.to.layers'] (CLI: --blocks path.to.layers)")

    def size(cls: type) -> tuple[int, int]:
        layers = _outermost(model, cls)
        return sum(p.numel() for _, m in layers for p in m.parameters()), len(layers)

    return _outermost(model, max(classes, key=lambda c: (size(c), c.__name__)))


def _outermost(model: nn.Module, cls: type) -> list[tuple[str, nn.Module]]:
    out: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if type(m) is cls and not any(name.startswith(f"{o}.") for o, _ in out):
            out.append((name, m))
    return out


def _stack_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules()
            if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1 and n]
