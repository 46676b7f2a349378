"""Planning for one rank of a parallel layout (`Step(layout=FSDP(...) | DDP(...))`): the
profiled costs become the rank's (`rematlab.distributed.pricing`), and every candidate plan is
verified by the rank's step run under it (`rematlab.distributed.engine.RankEngine`) — on the
job's process group when measured, on a fake group of N ranks when predicted."""

from __future__ import annotations

import copy
from dataclasses import replace

import torch.distributed as dist
from torch import nn

from rematlab.core.layout import FSDP
from rematlab.core.recipe import Step
from rematlab.distributed.engine import RankEngine
from rematlab.distributed.group import world_size
from rematlab.distributed.pricing import per_rank
from rematlab.distributed.shard import DTYPES, unit_names, unit_params
from rematlab.distributed.unshard import unsharded
from rematlab.exceptions import ConfigError
from rematlab.plans.plan import ChainCosts
from rematlab.preflight.fake import FakeSession
from rematlab.preflight.targets import Target
from rematlab.remat.structure import Structure


def adopt_sharded(model: nn.Module, step: Step) -> tuple[nn.Module, Step, nn.Module | None]:
    """A model the user sharded already (`fully_shard` or DDP) as what is planned: its
    unsharded twin on the meta device, the step with the layout it was sharded with, and the
    sharded model, whose shards the rank runs copy (`distributed.unshard`). A plain model
    comes back as it is, with no source."""
    found = unsharded(model)
    if found is None:
        return model, step, None
    twin, layout = found
    given = step.layout
    if given is not None and (given.kind != layout.kind or given.world_size not in (
            None, layout.world_size)):
        raise ConfigError(f"the model is sharded as {layout.describe()}, but the step says "
                          f"{given.describe()}")
    return twin, replace(step, layout=layout), model


def on_meta(model: nn.Module) -> bool:
    """Whether the model's weights were never allocated (built on the meta device)."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def profiled_model(model: nn.Module, step: Step) -> nn.Module:
    """The model whose layers are profiled for a rank: under an FSDP mixed-precision policy,
    a copy in its `param_dtype`, the dtype the gathered parameters and the activations have
    (FSDP2 casts the unit's inputs too); else the model itself."""
    layout = step.layout
    dtype = getattr(layout, "param_dtype", None)
    if dtype is None or all(p.dtype == DTYPES[dtype] for p in model.parameters()):
        return model
    return copy.deepcopy(model).to(DTYPES[dtype])


def for_rank(model: nn.Module, profiled: nn.Module, batch: object, st: Structure, step: Step,
             costs: ChainCosts, target: Target | None, source: nn.Module | None = None
             ) -> tuple[ChainCosts, RankEngine]:
    """The rank's costs and the engine that verifies plans for it (module docstring), from
    the costs of `profiled` (`profiled_model`) and structure `st` found on it; `target` is
    set when predicting; `source` holds the values a measured run copies (`adopt_sharded`;
    None: the model's own)."""
    layout = step.layout
    assert layout is not None
    predict = target is not None
    world = world_size(layout, predict)
    names = {id(m): n for n, m in profiled.named_modules()}
    chain = [names.get(id(b)) for b in st.blocks]  # a layer model's blocks are all named
    if isinstance(layout, FSDP) and layout.units is None and None in chain:
        raise ConfigError("this model's blocks are not modules of it: name the FSDP units "
                          "(FSDP(units=...))")
    units = unit_names(model, layout, [n for n in chain if n is not None])
    if not predict and world > 1:
        shared = [costs]
        dist.broadcast_object_list(shared, src=0)  # every rank plans from rank 0's profile
        costs = shared[0]
    offset = 1 if st.kind == "layers" else 0  # a layer model's chain starts with "before"
    block_units = [None] * costs.n
    for i, name in enumerate(chain):
        if name in units:
            block_units[i + offset] = units.index(name)
    scale = (sum(p.numel() * p.element_size() for p in model.parameters())
             / max(1, sum(p.numel() * p.element_size() for p in profiled.parameters())))
    costs = per_rank(costs, unit_params(model, units), block_units, layout, world, scale)
    cuda = predict and target.kind == "cuda"
    engine = RankEngine(model, batch, step, layout, world, units,
                        chain if st.kind == "layers" else None,
                        session=FakeSession(cuda=cuda) if predict else None,
                        unit=target.unit if predict else 1,
                        extra=target.blas_resident if cuda else 0, source=source)
    return costs, engine
