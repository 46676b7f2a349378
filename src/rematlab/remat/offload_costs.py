"""A layer's offload option, metered: the layer run once under the offloader
(`rematlab.remat.offload`) with the live-storage tracker counting device and host bytes apart,
as a measured or a fake (pre-flight) block is. The bytes are the run's; the seconds are the
plain layer's, the link's are added when the chain is priced (`rematlab.plans.offload`).

Offload is offered where host and device memory are two: on a CUDA device, or a CUDA target
of pre-flight. On a CPU they are one, and a copy to "host" frees nothing (`why_not`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from rematlab.core.probes import rounded
from rematlab.core.steps import block_step, preserved
from rematlab.plans.offload import Link, caps, option_name
from rematlab.plans.plan import OFFLOAD_INPUT, Option
from rematlab.preflight.targets import DEFAULT_LINK, HOST_MEMORY, Target, profile_of_device
from rematlab.remat.block import BlockCost
from rematlab.remat.offload import MIN_BYTES, Offloader
from rematlab.remat.ops import OptionRun

CPU_OFFLOAD = ("offload moves saved activations from device to host memory; on a CPU they "
               "are one memory, so it frees nothing and is not offered (plan for a GPU with "
               "predict=True and a target, or run on one)")


def why_not(device: torch.device, target: Target | None) -> str | None:
    """Why offload cannot be planned here (None: it can): only where device and host
    memory are apart."""
    kind = target.kind if target is not None else device.type
    return None if kind == "cuda" else CPU_OFFLOAD


def link_for(device: torch.device, target: Target | None) -> Link:
    """The host link offload is priced on: the target's, or that of the data-sheet profile
    of the GPU here (a card without one: the default PCIe Gen4 figures)."""
    if target is not None:
        return target.link
    props = torch.cuda.get_device_properties(device)
    sheet = profile_of_device(props.name, props.total_memory)
    return sheet.link if sheet is not None else Link(*DEFAULT_LINK, HOST_MEMORY)


def metered_offloads(layer: nn.Module, run: Callable[[torch.Tensor], torch.Tensor],
                     x_in: torch.Tensor, others: list[torch.Tensor], plain: BlockCost,
                     link: Link, unit: int = 1) -> list[Option]:
    """The layer's offload options (`plans.offload.caps`, from the plain layer's forward
    time), each metered (`metered_offload`), and "offload input" (`input_offload`); those
    that move nothing, or no more than a smaller cap, left out."""
    menu: list[Option] = []
    for cap in caps(link, plain.fwd_time):
        option = metered_offload(layer, run, x_in, others, plain, unit, cap)
        if option is not None and all(option.host > o.host for o in menu):
            menu.append(option)
    whole = input_offload(plain, unit)
    return menu + ([whole] if whole is not None else [])


def input_offload(plain: BlockCost, unit: int, min_bytes: int = MIN_BYTES) -> Option | None:
    """The layer checkpointed with its input in host memory ("offload input"), from its
    plain profile: the terms the solver gives a checkpointed layer (`plans.simulate`:
    its no-save forward; in backward its recomputation, stopped at its last saved tensor, then
    its backward over what it saved), with the input reloaded first and held on the host,
    not the device. Derived, not run: a fake CUDA twin recomputes outside pre-flight's CUDA
    dispatch, and the solver's checkpoint terms are the model this option shares. None
    for an input smaller than `min_bytes`."""
    if plain.x < min_bytes:
        return None
    out = rounded(plain.out.untyped_storage().nbytes(), unit)
    return Option(name=OFFLOAD_INPUT, saves=(), saved=0, keeps_input=False,
                  keeps_output=False, fwd_mem=plain.fwd_mem,
                  bwd_mem=plain.x + max(plain.rec_mem, plain.saved
                                        + (out if plain.keeps_output else 0) + plain.bwd_mem),
                  fwd_time=plain.fwd_time, bwd_time=plain.bwd_time, host=plain.x)


def metered_offload(layer: nn.Module, run: Callable[[torch.Tensor], torch.Tensor],
                    x_in: torch.Tensor, others: list[torch.Tensor], plain: BlockCost,
                    unit: int = 1, cap: int | None = None, min_bytes: int = MIN_BYTES
                    ) -> Option | None:
    """Layer `layer` (`run(x)` its forward) kept, its saved tensors offloaded up to `cap`
    bytes: what it holds on the device once its copies are done, the host bytes moved, its
    forward and backward peaks (the reload in the backward's), never below the plain
    layer's (`plain`, whose profile also counts kernels' scratch). None when nothing it
    saves is worth moving."""
    tracked = OptionRun(unit, False)
    offloader = Offloader([*layer.parameters(), *layer.buffers()], min_bytes, tracked.tracker)
    tracked.tracker.track([x_in, *layer.parameters(), *layer.buffers(), *others])

    def moved(x: torch.Tensor) -> torch.Tensor:
        with offloader.layer(0, (x, *others), cap):
            out = run(x)
        offloader.forwarded(1)  # the next layer's forward has ended: copies done
        return out

    with preserved(layer):
        block_step(moved, x_in, tracked)
    host = tracked.tracker.host_peak
    if host == 0:
        return None
    out_bytes = tracked.out_bytes
    saved = max(0, tracked.held - (out_bytes if tracked.keeps_output else 0))
    return Option(name=option_name(cap), saves=(), keeps_input=plain.keeps_input,
                  keeps_output=tracked.keeps_output, saved=saved,
                  fwd_mem=max(tracked.fwd_mem, plain.fwd_mem),
                  bwd_mem=max(tracked.bwd_mem, plain.bwd_mem + host),
                  fwd_time=plain.fwd_time, bwd_time=plain.bwd_time, host=host)
