"""A model with many identical layers profiled through a three-layer twin of itself.

Profiling a model that runs its own layer loop runs its whole step twice or more (the
layers' arguments captured, the tracked step that measures what runs before and after them,
the timed step), although the layers in between are alike and `Repeats` profiles one of
them: most of the planning time of a deep model, measured (GPT-2 with 12 layers) or
pre-flight (an 80-layer fake twin). Running the model with its layer list cut to its first,
second and last layer gives the same arguments to each layer, the same parts before and
after them, and one middle layer's live-byte increment; the rest follows by repetition.

Pre-flight, a four-layer twin's step gives the time one more layer adds to the step. It
applies only where that is safe: the layers are the whole of one `nn.ModuleList`, and all
of them after the first are alike — class, `repr`, parameter and buffer shapes, and every
plain attribute (an `attention_type`, a sliding window) other than the layer's index. The
model's own loop then runs the three layers as it would run eighty (`for layer in
self.layers[: config.num_hidden_layers]`, `enumerate(self.h)`). A measured plan is verified
on the whole model's step all the same (`Planning.choose`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

from torch import nn

from rematlab.remat.block import BlockCost
from rematlab.remat.chain import structure_key
from rematlab.remat.outer import OuterCost

MIN_LAYERS = 5  # the twins run three and four layers: on fewer they would save nothing
_INDEX_WORDS = ("idx", "index", "layer_id", "layer_num")  # attributes that number a layer


def _attributes(module: nn.Module) -> tuple:
    """The plain attributes of a layer and its submodules, its index left out."""
    return tuple(
        (name, key, value) for name, sub in module.named_modules()
        for key, value in sorted(vars(sub).items())
        if isinstance(value, (bool, int, float, str)) and not key.startswith("_")
        and not any(word in key for word in _INDEX_WORDS))


def _signature(layer: nn.Module) -> tuple:
    return structure_key(layer, []), _attributes(layer)


def _container(model: nn.Module, layers: list[nn.Module]) -> nn.ModuleList | None:
    """The `nn.ModuleList` that holds exactly `layers`, in order, if there is one."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == len(layers) \
                and all(a is b for a, b in zip(module, layers, strict=True)):
            return module
    return None


@contextlib.contextmanager
def shortened(model: nn.Module, layers: list[nn.Module], keep: int = 3
              ) -> Iterator[list[nn.Module] | None]:
    """Within the block, `model` runs only its first `keep - 1` layers and its last, which
    it yields; None (and the model unchanged) where that is not safe (module docstring)."""
    container = _container(model, layers)
    rest = {_signature(layer) for layer in layers[1:]} if len(layers) >= MIN_LAYERS else set()
    if container is None or len(rest) != 1:
        yield None
        return
    short = [*layers[: keep - 1], layers[-1]]
    full = container._modules
    container._modules = {str(i): layer for i, layer in enumerate(short)}
    try:
        yield short
    finally:
        container._modules = full


def stretched(rows: list[BlockCost], outer: OuterCost, longer: OuterCost | None, n: int
              ) -> tuple[list[BlockCost], OuterCost]:
    """The three-layer twin's profiles and outer costs (`outer.outer_costs`) as the
    `n` layers': the second layer's profile for every middle one, its live bytes repeated,
    and the step's time grown by what one more middle layer added to it. Pre-flight, that
    is the four-layer twin's step (`longer`) less the three-layer one's, which includes what
    a layer profiled alone does not see; measured (`longer` None), it is the middle layer's
    own forward and backward: a difference of two timed steps would multiply their noise by
    the layers added."""
    first, middle, last = rows
    live = outer.layer_live
    step = live[2] - live[1]
    more = n - 3
    per_layer = (longer.step_time - outer.step_time if longer is not None
                 else middle.fwd_time + middle.bwd_time)
    grown = replace(outer, layer_live=[*live[:3], *(live[2] + step * i
                                                    for i in range(1, more + 1)),
                                       live[3] + step * more],
                    step_time=outer.step_time + more * per_layer)
    if longer is not None and outer.step_range is not None:
        grown.step_range = tuple(a + more * (b - a) for a, b in
                                 zip(outer.step_range, longer.step_range, strict=True))
    return [first, *(replace(middle) for _ in range(n - 2)), last], grown
