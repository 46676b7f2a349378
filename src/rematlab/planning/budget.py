"""`budget="auto"`: the memory a training step may use on this device, and how it was derived.

A step's peak, as rematlab measures and plans it, counts every tensor of the step — the
parameters, buffers and batch that already exist included — and no other tensor (another
model on the same card is not the step's: `rematlab.core.probes`). So the budget is what the
step may hold in all, its tensors that already exist (`resident`) plus what it can still get:
on CUDA, the device's free memory and this process's cache (reserved, not allocated), while
the process's other tensors and the CUDA context stay out of it and are named in the line
that says how the budget was derived; on CPU, the memory still available to this
process, the tighter of the container's limit (cgroup v2 `memory.max` / v1
`memory.limit_in_bytes`, less its current usage) and the kernel's `MemAvailable`. Either way
a safety margin is kept back: 5 % of the device's or container's memory, at least 256 MiB,
for the allocator's fragmentation, other processes and the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rematlab.core.batch import tensors
from rematlab.core.units import format_bytes, parse_bytes
from rematlab.exceptions import ConfigError

MARGIN_FRACTION = 0.05
MARGIN_MIN = 256 * 2**20
_NO_LIMIT = 2**60  # cgroup v1 writes a huge number where there is no limit


@dataclass(frozen=True)
class DeviceBudget:
    """A budget in bytes and one line saying where it comes from."""

    nbytes: int
    how: str


def is_auto(budget: object) -> bool:
    return isinstance(budget, str) and budget.strip().lower() == "auto"


def checked(budget: str | int) -> str | int:
    """'auto', or the budget in bytes: the one place a budget is parsed, at the edge (the
    CLI, `plan`, `prepare(...).choose`, `max_batch`), so a bad size fails before any work;
    a budget already checked passes through unchanged."""
    return "auto" if is_auto(budget) else parse_bytes(budget)


def resolve_budget(budget: str | int, device: torch.device, resident: int = 0) -> DeviceBudget:
    """`budget` in bytes: a size as given, or 'auto' (`device_budget`)."""
    budget = checked(budget)
    if budget == "auto":
        return device_budget(device, resident)
    return DeviceBudget(budget, f"given: {format_bytes(budget)}")


def device_budget(device: torch.device, resident: int = 0, *,
                  cgroup: Path = Path("/sys/fs/cgroup"),
                  meminfo: Path = Path("/proc/meminfo"), cuda: Any = torch.cuda
                  ) -> DeviceBudget:
    """The memory a step may use on `device` (see the module docstring); `resident`: bytes of
    the step's tensors that already exist (parameters, buffers, the batch); `cuda`: where
    the CUDA statistics come from (`torch.cuda`; a fake card in tests)."""
    if device.type == "cuda":
        free, total = cuda.mem_get_info(device)
        held = cuda.memory_allocated(device)
        reserved = cuda.memory_reserved(device)
        cached = reserved - held
        own = min(held, resident)
        other = held - own
        context = max(0, total - free - reserved)  # the CUDA context and other processes
        margin = max(int(MARGIN_FRACTION * total), MARGIN_MIN)
        nbytes = own + cached + free - margin
        how = (f"auto on {device}: {format_bytes(free)} free + {format_bytes(cached)} cached "
               f"by this process + {format_bytes(own)} of the step's tensors "
               f"already resident, less a margin of {format_bytes(margin)} (5 % of "
               f"{format_bytes(total)}, at least 256 MiB); not the step's: "
               f"{format_bytes(other)} of other tensors in this process, "
               f"{format_bytes(context)} of CUDA context and other processes")
    else:
        available = _meminfo(meminfo, "MemAvailable")
        total = _meminfo(meminfo, "MemTotal")
        limit = _cgroup_limit(cgroup)
        if limit is not None:
            limit_bytes, used, source = limit
            headroom = min(available, limit_bytes - used)
            size = limit_bytes
            where = (f"container limit {format_bytes(limit_bytes)} ({source}) less "
                     f"{format_bytes(used)} in use, MemAvailable {format_bytes(available)}: "
                     f"{format_bytes(headroom)} available")
        else:
            headroom, size = available, total
            where = f"no container limit; MemAvailable {format_bytes(available)}"
        margin = max(int(MARGIN_FRACTION * size), MARGIN_MIN)
        nbytes = resident + headroom - margin
        how = (f"auto on cpu: {where}, plus {format_bytes(resident)} of the step's tensors "
               f"already resident, less a margin of {format_bytes(margin)} (5 % of "
               f"{format_bytes(size)}, at least 256 MiB)")
    if nbytes <= 0:
        raise ConfigError(f"no memory is left for a training step ({how})")
    return DeviceBudget(nbytes, how)


def _meminfo(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    raise ConfigError(f"cannot read {key} from {path}: give the budget in bytes")


def _cgroup_limit(root: Path) -> tuple[int, int, str] | None:
    """(limit, usage, source file) of this container's memory, or None without a limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes",
                                    "memory/memory.usage_in_bytes")):
        try:
            text = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if text == "max" or not text.isdigit() or int(text) >= _NO_LIMIT:
            return None
        return int(text), usage, str(root / limit_file)
    return None


def derive(budget: str | int, model: nn.Module, batch: object, state: int = 0
           ) -> DeviceBudget:
    """`budget` in bytes, with how it was derived: a size, or 'auto' for what this device has
    (`resolve_budget`), where the model's parameters, buffers, the batch and `state` bytes of
    optimizer state that already exist count as resident."""
    return resolve_budget(budget, next(tensors(batch)).device, state + resident(model, batch))


def resident(model: nn.Module, batch: object = ()) -> int:
    """Bytes of the step's tensors that exist before it runs: `model`'s parameters and
    buffers (a sharded parameter's local shard), and `batch`'s tensors."""
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).untyped_storage().nbytes()
               for t in [*model.parameters(), *model.buffers(), *tensors(batch)])
