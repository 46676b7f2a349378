"""A model the user sharded already, read back as what rematlab plans: its unsharded twin on
the meta device and the layout it was sharded with.

FSDP2 forbids `deepcopy` of a sharded module and swaps each unit's class for a dynamic
`FSDP<Class>`; DDP wraps the model. The twin is rebuilt module by module instead: each
module's own class, its attributes shared (configs, flags), its parameters and buffers as meta
tensors of the *global* shapes (a DTensor's shape is the whole parameter's), and none of
FSDP's hooks or composable state. The layout (world size, units, `reshard_after_forward`,
the mixed-precision policy, DDP's bucket size) is read from FSDP's and DDP's own state.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rematlab.core.layout import DDP, FSDP
from rematlab.distributed.shard import DTYPES
from rematlab.exceptions import ConfigError
from rematlab.remat.layers import is_plan, rebound

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_FSDP_FLAGS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


def unsharded(model: nn.Module) -> tuple[nn.Module, FSDP | DDP] | None:
    """(the unsharded twin, the layout) of a model under `fully_shard` or DDP (the module
    DDP wraps is itself unsharded); None for a plain model."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model.module, DDP(model.process_group.size(),
                                 bucket_cap_mb=model.bucket_bytes_cap / 2 ** 20)
    units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not units:
        return None
    if units[0] != "" and not getattr(model, "_is_fsdp_managed_module", False):
        raise ConfigError("only some of the model's modules are under fully_shard: shard the "
                          "root too (fully_shard(model)), or plan the unsharded model with "
                          "step=Step(layout=FSDP(...))")
    # a model inside another's fully_shard (auto()'s wrapper) has its root there: managed
    units = [n for n in units if n]
    groups = [g for n in units or [""]
              if (g := model.get_submodule(n)._get_fsdp_state()._fsdp_param_group) is not None]
    if not groups:
        raise ConfigError("the sharded model has no parameters")
    unit = groups[0]
    policy = unit.mp_policy
    layout = FSDP(unit.mesh_info.mesh.size(), units=tuple(units),
                  reshard_after_forward=unit.post_forward_mesh_info is not None,
                  param_dtype=_dtype_name(policy.param_dtype),
                  reduce_dtype=_dtype_name(policy.reduce_dtype))
    return _rebuild(model, {}), layout


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    if dtype is None:
        return None
    if dtype not in _DTYPE_NAMES:
        raise ConfigError(f"the model's MixedPrecisionPolicy uses {dtype}: rematlab plans "
                          "bf16, fp16 and fp32")
    return _DTYPE_NAMES[dtype]


def _base_class(module: nn.Module) -> type:
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if not isinstance(module, FSDPModule):
        return cls
    return next(c for c in cls.__mro__[1:]
                if issubclass(c, nn.Module) and not issubclass(c, FSDPModule))


def _rebuild(module: nn.Module, made: dict[int, Any]) -> nn.Module:
    if id(module) in made:
        return made[id(module)]
    cls = _base_class(module)
    twin = cls.__new__(cls)
    made[id(module)] = twin
    state: dict[str, Any] = {}
    for key, value in vars(module).items():
        if key.startswith("__composable_api_") or key in _FSDP_FLAGS or is_plan(key, value):
            continue  # FSDP's state, and a plan the sharded model was given before
        if key.endswith("hooks") or "_hooks_" in key:
            value = type(value)()  # FSDP's (and anyone's) hooks stay with the sharded model
        elif key in ("_parameters", "_buffers"):
            value = {n: _meta(t, made) if t is not None else None for n, t in value.items()}
        elif key == "_modules":
            value = {n: _rebuild(c, made) if c is not None else None for n, c in value.items()}
        elif isinstance(value, torch.Tensor):
            value = _meta(value, made)
        state[key] = value
    twin.__dict__.update({k: rebound(v, module, twin) for k, v in state.items()})
    return twin


def _meta(t: torch.Tensor, made: dict[int, Any]) -> torch.Tensor:
    """`t`'s global shape on the meta device, once per tensor (tied weights stay tied)."""
    if id(t) not in made:
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        made[id(t)] = (nn.Parameter(meta, requires_grad=t.requires_grad)
                       if isinstance(t, nn.Parameter) else meta)
    return made[id(t)]
