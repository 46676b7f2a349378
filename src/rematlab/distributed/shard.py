"""Shard a model as a layout says: FSDP2's `fully_shard` on each unit, then on the root (as
torchtitan applies it), or DDP around the whole model. Applied to rematlab's own copies of the
user's model, after the plan (checkpointing goes inside the units, as torchtitan orders it)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rematlab.core.layout import DDP, FSDP
from rematlab.exceptions import ConfigError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def unit_names(model: nn.Module, layout: FSDP | DDP, layers: list[str]) -> list[str]:
    """The modules `fully_shard` goes on before the root, by name: the layout's, checked
    against the model, or the layers the plan runs over (none for DDP)."""
    if not isinstance(layout, FSDP):
        return []
    if layout.units is None:
        return list(layers)
    names = dict(model.named_modules())
    for name in layout.units:
        if name not in names or name == "":
            raise ConfigError(f"FSDP unit {name!r} is not a module of the model (units are "
                              "names such as 'model.layers.0'; the root is sharded anyway)")
    _refuse_split_ties(model, list(layout.units))
    # fully_shard goes on a module after the units inside it (torch refuses a parent first):
    # deepest first, the order the user gave kept among units of one depth
    return sorted(layout.units, key=lambda n: -n.count("."))


def _refuse_split_ties(model: nn.Module, units: list[str]) -> None:
    """A parameter shared by modules of two units (a tied embedding in one unit, the head
    that shares it in another, or in the root) is refused here, as FSDP2 refuses it at the
    first forward: tied parameters go in one unit."""
    unit_of: dict[int, str] = {}
    for name in sorted(["", *units], key=lambda n: (n != "", n.count("."))):  # outer first
        for m in model.get_submodule(name).modules():
            unit_of[id(m)] = name
    owner: dict[int, tuple[str, str]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, param in module.named_parameters(recurse=False):
            here = (unit_of[id(module)], f"{mname}.{pname}".lstrip("."))
            first = owner.setdefault(id(param), here)
            if first[0] != here[0]:
                raise ConfigError(f"{first[1]} and {here[1]} are one tied parameter in two "
                                  f"FSDP units ({first[0] or 'the root'}, "
                                  f"{here[0] or 'the root'}): put the modules that share it "
                                  "in one unit")


def unit_params(model: nn.Module, units: list[str]) -> list[list[nn.Parameter]]:
    """Each unit's own parameters (those of a nested unit excluded, as FSDP2 groups them),
    then the root's (the rest)."""
    seen: set[int] = set()
    own: dict[str, list[nn.Parameter]] = {}
    for name in sorted(units, key=lambda n: -n.count(".")):  # innermost units first
        own[name] = [p for p in model.get_submodule(name).parameters() if id(p) not in seen]
        seen |= {id(p) for p in own[name]}
    return [own[n] for n in units] + [[p for p in model.parameters() if id(p) not in seen]]


def shard(model: nn.Module, units: list[nn.Module], layout: FSDP | DDP, mesh: DeviceMesh
          ) -> nn.Module:
    """`model` sharded by `layout` over `mesh`: FSDP2 in place on `units` then the root (the
    model itself comes back), or a `DistributedDataParallel` around it."""
    if isinstance(layout, DDP):
        from torch.nn.parallel import DistributedDataParallel

        cuda = mesh.device_type == "cuda"
        return DistributedDataParallel(
            model, bucket_cap_mb=layout.bucket_cap_mb, process_group=mesh.get_group(),
            device_ids=[torch.cuda.current_device()] if cuda else None)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES.get(layout.param_dtype or ""),
        reduce_dtype=DTYPES.get(layout.reduce_dtype or ""))
    for unit in [*units, model]:  # the units, then the root
        fully_shard(unit, mesh=mesh, reshard_after_forward=layout.reshard_after_forward,
                    mp_policy=policy)
    return model
