"""How the user's step is spread over processes: a parallel layout, part of `Step`.

Each rank of a data-parallel job runs the same step on its own micro-batch, but holds a
different sum of memory (issue 37):

- `FSDP` (`torch.distributed.fsdp.fully_shard`, FSDP2): 1/N of every parameter, gradient and
  optimizer state; the all-gathered parameters of the unit running now (and, in backward, of
  the one prefetched); the root's gathered parameters from its forward to its backward;
  reduce-scatter buffers; with a `MixedPrecisionPolicy`, low-precision gathered copies.
- `DDP` (`torch.nn.parallel.DistributedDataParallel`): every parameter, gradient and
  optimizer state whole, plus the gradient buckets the reducer allocates (`bucket_cap_mb`).

A plan is made for the unsharded model and applied before sharding, as torchtitan applies
activation checkpointing before `fully_shard`; rematlab shards its own copies of the model the
way the fields say (`rematlab.distributed`). These classes are plain data: nothing here
imports `torch.distributed`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rematlab.exceptions import ConfigError

_DTYPES = ("bf16", "fp16", "fp32")
# DDP bucket sizes that mean something: from 1 KiB (below it every parameter is reduced alone,
# whatever the number says) to 1 TiB (one bucket for any model)
MIN_BUCKET_MB, MAX_BUCKET_MB = 2.0 ** -10, 2.0 ** 20


def _world(world_size: int | None) -> None:
    if world_size is None:
        return
    if isinstance(world_size, bool) or not isinstance(world_size, int) \
            or not 1 <= world_size <= 1_000_000:
        raise ConfigError(f"world size must be an integer in [1, 1000000], got "
                          f"{world_size!r}")


def _ranks(world_size: int | None) -> str:
    return f"{world_size} ranks" if world_size else "the job's ranks"


@dataclass(frozen=True)
class FSDP:
    """FSDP2 over `world_size` ranks (None: the initialised process group's size).

    `units`: the modules `fully_shard` is applied to, by name ("model.layers.0", ...), before
    the root; None shards each layer rematlab finds, then the root, as torchtitan does.
    `reshard_after_forward`: free each unit's gathered parameters after its forward (gather
    them again for backward). `param_dtype` / `reduce_dtype`: the `MixedPrecisionPolicy`
    ("bf16", "fp16", "fp32"; None keeps the parameters' own dtype)."""

    world_size: int | None = None
    units: tuple[str, ...] | None = None
    reshard_after_forward: bool = True
    param_dtype: str | None = None
    reduce_dtype: str | None = None

    kind = "fsdp"

    def __post_init__(self) -> None:
        _world(self.world_size)
        if self.units is not None:
            if isinstance(self.units, str) or not isinstance(self.units, Sequence) \
                    or not all(isinstance(u, str) and u for u in self.units):
                raise ConfigError("FSDP units are module names, e.g. ('model.layers.0', ...), "
                                  f"got {self.units!r}"[:200])
            repeated = sorted({u for u in self.units if self.units.count(u) > 1})
            if repeated:
                raise ConfigError(f"FSDP unit {repeated[0]!r} is listed twice: fully_shard "
                                  "goes on each module once")
            object.__setattr__(self, "units", tuple(self.units))
        if not isinstance(self.reshard_after_forward, bool):
            raise ConfigError("reshard_after_forward must be True or False")
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _DTYPES:
                raise ConfigError(f"{name} must be one of {', '.join(_DTYPES)} (or None), "
                                  f"got {value!r}")

    def describe(self) -> str:
        mp = f", params {self.param_dtype}" if self.param_dtype else ""
        mp += f", reduce {self.reduce_dtype}" if self.reduce_dtype else ""
        keep = "" if self.reshard_after_forward else ", kept gathered after forward"
        return f"FSDP2 over {_ranks(self.world_size)}{mp}{keep}"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "world_size": self.world_size,
                "units": list(self.units) if self.units is not None else None,
                "reshard_after_forward": self.reshard_after_forward,
                "param_dtype": self.param_dtype, "reduce_dtype": self.reduce_dtype}


@dataclass(frozen=True)
class DDP:
    """DistributedDataParallel over `world_size` ranks (None: the process group's size),
    its gradients reduced in buckets of `bucket_cap_mb` MiB (torch's default: 25)."""

    world_size: int | None = None
    bucket_cap_mb: float = 25.0

    kind = "ddp"

    def __post_init__(self) -> None:
        _world(self.world_size)
        if isinstance(self.bucket_cap_mb, bool) or not isinstance(self.bucket_cap_mb,
                                                                  (int, float)) \
                or not MIN_BUCKET_MB <= self.bucket_cap_mb <= MAX_BUCKET_MB:
            raise ConfigError(f"bucket_cap_mb must be a number of MiB from 1/1024 (1 KiB) to "
                              f"{MAX_BUCKET_MB:.0f} (1 TiB); torch's default is 25; got "
                              f"{self.bucket_cap_mb!r}")

    def describe(self) -> str:
        return f"DDP over {_ranks(self.world_size)}, {self.bucket_cap_mb:g} MiB buckets"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "world_size": self.world_size,
                "bucket_cap_mb": self.bucket_cap_mb}


Layout = FSDP | DDP


def check_layout(layout: object) -> None:
    """Refuses anything that is not a layout (a Step's `layout`)."""
    if layout is not None and not isinstance(layout, (FSDP, DDP)):
        raise ConfigError(f"layout must be rematlab.FSDP(...) or rematlab.DDP(...), got "
                          f"{type(layout).__name__}")
