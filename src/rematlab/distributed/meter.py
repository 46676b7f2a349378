"""The live-storage tracker for one rank of a sharded step.

Two things a plain dispatch tracker misses under FSDP2, both handled as torch's own
`FSDPMemTracker` handles them (the two agree to the byte on the tests' models):

- parameters, gradients and optimizer state are `DTensor`s, wrapper subclasses without
  storage of their own: each is counted by its local shard (`__tensor_flatten__`);
- FSDP2 gathers a unit's parameters into storages it frees and re-allocates with
  `UntypedStorage.resize_`, which no dispatch mode sees: the method is wrapped while the
  tracker is active, and the bytes such storages hold are reported as *gathered*.

At every new peak the tracker keeps what each kind of tensor held (`at_peak`): the resident
tensors registered by kind (`track(tensors, kind)`), the gathered parameters, and the rest
(activations, gradients in flight, collective buffers).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from rematlab.core.probes import LiveTensorTracker, rounded

GATHERED = "gathered parameters"
OTHER = "activations, gradients and buffers"


class RankTracker(LiveTensorTracker):
    """`LiveTensorTracker` for sharded steps (module docstring)."""

    method = "dispatch_live_storages+dtensor_shards+storage_resize"

    def __init__(self, unit: int = 1) -> None:
        super().__init__(unit=unit)
        self._kind: dict[int, str] = {}
        self.by_kind: dict[str, int] = {}
        self.at_peak: dict[str, int] = {}
        self._tracking: str = OTHER
        self._resize: Any = None

    def track(self, tensors: Iterable[torch.Tensor], kind: str = OTHER) -> None:
        """Register tensors that exist before the step, as `kind` ("parameter shards", ...)."""
        self._tracking = kind
        try:
            super().track(tensors)
        finally:
            self._tracking = OTHER

    def _register(self, t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            for name in names:
                self._register(getattr(t, name))
            return
        if not isinstance(t, torch.Tensor) or t.is_sparse:
            return
        key = id(t.untyped_storage())
        fresh = key not in self._sizes
        super()._register(t)
        if fresh and self._tracking != OTHER:
            self._kind[key] = self._tracking
            self.by_kind[self._tracking] = self.by_kind.get(self._tracking, 0) \
                + self._sizes[key]

    def _free(self, key: int) -> None:
        kind = self._kind.pop(key, None)
        if kind is not None:
            self.by_kind[kind] -= self._sizes.get(key, 0)
        super()._free(key)

    def _bump(self, level: int | None = None) -> None:
        if (self.live if level is None else level) > self.peak:
            self.at_peak = self._split()
        super()._bump(level)

    def _split(self) -> dict[str, int]:
        """What each registered kind and the gathered parameters hold now, and the rest."""
        known = {k: v for k, v in self.by_kind.items() if v}
        return {**known, OTHER: self.live - sum(known.values())}

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._sizes and self._refs[key]() is not storage:
            self._free(key)  # a freed storage's id, reused before its callback ran
        if key not in self._sizes:  # gathered into a storage made before tracking
            self._sizes[key] = 0
            self._refs[key] = weakref.ref(storage, lambda _, k=key: self._free(k))
        old = self._sizes[key]
        new = rounded(storage.nbytes(), self.unit)
        kind = self._kind.get(key)
        if kind is not None:
            self.by_kind[kind] -= old
        self._kind[key] = GATHERED
        self.by_kind[GATHERED] = self.by_kind.get(GATHERED, 0) + new
        self._sizes[key] = new
        self.live += new - old
        self._bump()

    def __enter__(self) -> RankTracker:
        original = self._resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = original(storage, size)
            tracker._resized(storage)
            return out
        torch.UntypedStorage.resize_ = resize_
        self.at_peak = self._split()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*exc)
