"""Plans for a device that is not here, for models that do not fit here: the planner's costs
from fake twins of the model and batch (`rematlab.preflight`), priced on a target's roofline.

The model may be real or built on the meta device (its weights never allocated); the batch may
be real tensors or meta tensors (shapes only). Nothing is measured, so nothing is verified: a
predicted plan says so, and for which target (`rematlab.planning.planner.Planning.target`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from rematlab.core.batch import tensors
from rematlab.core.recipe import Step
from rematlab.core.units import format_bytes
from rematlab.exceptions import ConfigError
from rematlab.planning.budget import MARGIN_FRACTION, MARGIN_MIN, DeviceBudget, is_auto
from rematlab.plans.plan import ChainCosts
from rematlab.preflight.band import band
from rematlab.preflight.targets import Target, resolve_target
from rematlab.remat.chain import profile_chain
from rematlab.remat.layer_costs import profile_layers
from rematlab.remat.offload_costs import why_not
from rematlab.remat.profiling import Profiling
from rematlab.remat.structure import Structure

# A predicted plan keeps this share (per cent) of its simulated peak free: it is not verified,
# and the simulator can miss a few hundred kilobytes (allocator alignment, small scalars) that
# a measured plan's verification would catch (docs/benchmarks/preflight.md).
MARGIN_PERCENT = 1


def with_margin(peak: int) -> int:
    """The smallest budget a predicted plan of simulated `peak` fits, margin included."""
    return -(-peak * (100 + MARGIN_PERCENT) // 100)


def upper_end(target: Target | None, family: str, peak: int, where: str) -> int:
    """The most a predicted plan whose reserved (`where` "card") or rank ("rank") peak is
    `peak` may hold: its band's upper end on a GPU target (`rematlab.preflight.band`), else
    the peak and its margin."""
    if target is None or target.kind != "cuda":
        return with_margin(peak)
    return band(peak, (where, "reserved", family)).upper


def room(budget: int) -> int:
    """The largest simulated peak a predicted plan may have within `budget` (the inverse of
    `with_margin`: `room(with_margin(p)) >= p`, in integers)."""
    return budget * 100 // (100 + MARGIN_PERCENT)


def predicted_costs(model: nn.Module, batch: object, st: Structure, device: object,
                    step: Step, target: str | Target | dict | None, ops: bool = False,
                    offload: bool = False) -> tuple[ChainCosts, Target]:
    """The costs of `model`'s `step` on `batch` as `target` would run it (with `ops`, each
    block's menu of op-level options too; with `offload`, each layer's offload option), and
    the target (None: the device the batch is on, calibrated). On a CUDA target the BLAS
    workspaces are resident (`Target.blas_resident`)."""
    kind = (torch.device(device).type if device is not None
            else next(tensors(batch)).device.type)
    tgt = resolve_target(target, kind)
    how = Profiling(step, ops=ops, offload=offload, target=tgt)
    if offload:
        offloadable(st, step, torch.device(kind), tgt)
    if st.kind == "layers":
        costs = profile_layers(model, batch, st.blocks, how)
    else:
        costs = profile_chain(st.blocks, batch, how)
    return with_resident(costs, tgt.blas_resident), tgt


def offloadable(st: Structure, step: Step, device: torch.device, target: Target | None
                ) -> None:
    """Refuse offload where it cannot be planned, saying why: where host and device memory
    are one (a CPU), or for a chain of blocks (offload is planned per layer of a model that
    runs its own layer loop)."""
    why = why_not(device, target)
    if why is None and st.kind != "layers":
        why = ("offload is planned per layer of a model that runs its own layer loop (a "
               "transformers model, or blocks=...); this model was found as a chain of "
               "blocks")
    if why is not None:
        raise ConfigError(why)


def with_resident(costs: ChainCosts, nbytes: int) -> ChainCosts:
    """`costs` with `nbytes` more held through the whole step, optimizer step included (the
    BLAS workspaces: a GPU target's, or the card's here when measured)."""
    return replace(costs, base=costs.base + nbytes,
                   optimizer_peak=costs.optimizer_peak + nbytes)


def card_budget(budget: str | int, target: Target | None) -> DeviceBudget | None:
    """`budget="auto"` for a GPU target (`target_budget`); None where the budget is a size
    or the target a CPU, which derive it as a measured plan does."""
    if target is not None and target.kind == "cuda" and is_auto(budget):
        return target_budget(target)
    return None


def target_budget(target: Target) -> DeviceBudget:
    """What a step may reserve on a GPU target: the card less the CUDA context and less the
    margin `device_budget` keeps on a real device (5 %, at least 256 MiB). A plan is held
    to it by its reserved peak (`rematlab.planning.reserve`), segments' tails and
    fragmentation included."""
    margin = max(int(MARGIN_FRACTION * target.memory), MARGIN_MIN)
    return DeviceBudget(target.usable - margin,
                        f"{target.name}: {format_bytes(target.memory)} less the CUDA context "
                        f"{format_bytes(target.context)} and a margin of "
                        f"{format_bytes(margin)}, against the step's reserved peak")
