"""The process group a rank's step runs on: the user's, initialised by `torchrun` (gloo on CPU,
NCCL on GPUs), for a measured plan; or a fake one of N ranks in this process for a predicted
plan (`torch.testing._internal.distributed.fake_pg`, whose collectives return at once and move
no data: every rank's tensors have rank 0's shapes, which is all a peak needs)."""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rematlab.core.layout import DDP, FSDP
from rematlab.exceptions import ConfigError

# The largest FSDP shard group predicted: fully_shard makes N pieces of every parameter
# (`_chunk_with_empty`), about 10 µs each on the fake group, so time grows with parameters x N
# (mlp3: 3.5 s at 4,096 ranks, 66 s at 1,000,000). A DDP rank's bytes do not depend on N, and
# its prediction builds no N-way structure, so any world size is predicted.
MAX_PREDICTED_SHARDS = 4096


def world_size(layout: FSDP | DDP, predict: bool) -> int:
    """The ranks a layout is for: its own count, else (measured) the process group's. A
    measured layout needs the user's process group, and one of that size."""
    if predict:
        if layout.world_size is None:
            raise ConfigError(f"a predicted {layout.kind.upper()} plan needs the world size: "
                              f"say how many ranks (--{layout.kind} N)")
        if isinstance(layout, FSDP) and layout.world_size > MAX_PREDICTED_SHARDS:
            raise ConfigError(f"a predicted FSDP plan runs one rank on a fake group, which "
                              f"shards every parameter into N pieces: {layout.world_size} "
                              f"ranks would take minutes. Predict at most "
                              f"{MAX_PREDICTED_SHARDS} (the shard group of an HSDP job, "
                              "which replicates across the rest)")
        return layout.world_size
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(f"a measured {layout.kind.upper()} plan runs on the job's process "
                          "group, and none is initialised: run under torchrun (or call "
                          "torch.distributed.init_process_group first), or predict the plan "
                          "for N ranks (predict=True, --predict)")
    size = dist.get_world_size()
    if layout.world_size is not None and layout.world_size != size:
        raise ConfigError(f"the layout is for {layout.world_size} ranks but the process group "
                          f"has {size}")
    return size


@contextlib.contextmanager
def mesh_for(size: int, device_type: str, fake: bool) -> Iterator[DeviceMesh]:
    """A one-dimensional mesh over `size` ranks: of the user's group, or (`fake`) of a fake
    group made for the block and destroyed after it."""
    if not fake:
        yield init_device_mesh(device_type, (size,))
        return
    if dist.is_initialized():
        raise ConfigError("a predicted layout simulates its ranks on a process group of its "
                          "own: predict outside an initialised process group")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=size, store=FakeStore())
    try:
        yield init_device_mesh(device_type, (size,))
    finally:
        dist.destroy_process_group()


def join_job(device: str) -> None:
    """Join the process group `torchrun` describes in the environment (RANK, WORLD_SIZE,
    MASTER_ADDR, ...), over NCCL for a GPU and gloo otherwise; nothing outside a job or when
    the group is up already (a measured layout then says how to run it)."""
    if dist.is_initialized() or not {"RANK", "WORLD_SIZE"} & os.environ.keys():
        return
    job_environment()
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    atexit.register(_leave)  # after an error too: a rank that leaves first must not abort


def job_environment() -> None:
    """torchrun's variables, checked: a job has a RANK below its WORLD_SIZE (integers), a
    LOCAL_RANK if any that is an integer, and the MASTER_ADDR and MASTER_PORT its ranks meet
    at. A half-set environment is bad input, said once, not a traceback from the store."""
    env = os.environ
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise ConfigError(f"a torchrun environment sets RANK, WORLD_SIZE, MASTER_ADDR and "
                          f"MASTER_PORT; {', '.join(missing)} missing (run under torchrun, "
                          "or unset RANK and WORLD_SIZE)")
    values = {}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        if key in env:
            if not env[key].isdigit():
                raise ConfigError(f"{key} must be a non-negative integer, got {env[key]!r}")
            values[key] = int(env[key])
    if not values["RANK"] < values["WORLD_SIZE"]:
        raise ConfigError(f"RANK {values['RANK']} is not below WORLD_SIZE "
                          f"{values['WORLD_SIZE']}")
    if not 0 < values["MASTER_PORT"] < 65536:
        raise ConfigError(f"MASTER_PORT must be a port number, got {env['MASTER_PORT']!r}")


def leave_job() -> None:
    """Leave the group `join_job` joined, every rank together (a barrier, then the group
    destroyed): a rank that exits while another still talks to it aborts in gloo's C++."""
    if dist.is_initialized():
        dist.barrier()
    _leave()


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
