"""Saved activations moved to host memory during forward and back before backward needs them:
the third choice per layer beside keeping and recomputing (issue 61).

Built on `torch.autograd.graph.saved_tensors_hooks`, as `torch.autograd.graph.save_on_cpu`
and torchtune's `OffloadActivations` are, with what their users were bitten by made explicit:

- **What moves.** A tensor a layer saves for backward, at least `min_bytes`, on the device.
  Never a parameter or buffer (its storage stays on the device anyway), never the layer's own
  inputs (the previous layer's output, alive beside it), never a view of a storage that stays
  on the device for another saved tensor (copying it frees nothing); a storage saved twice is
  copied once.
- **Copies off the compute stream.** On CUDA each device-to-host copy runs on a side stream
  that first waits for the compute stream, into a pinned host buffer from a pool (a
  `cudaHostAlloc` costs milliseconds: buffers are kept and reused by size). The device tensor
  is kept alive until its copy's event has completed, then dropped: the race behind
  torchtune #1867 (a tensor freed while its copy still read it) cannot happen.
- **Reloads a layer ahead.** When backward first needs a layer's tensors, that layer's reloads
  and the next layer's (backward runs layers in reverse) start on the side stream; the compute
  stream waits for a tensor's event before using it. A host buffer returns to the pool once
  its reload has completed.
- **On a CPU** host and device memory are one: the copies still run (the mechanism and its
  bookkeeping are tested there), synchronously, and save nothing; planning on a CPU offers no
  offload for that reason.

`Offloader.layer(i)` is the context a layer's forward runs in; `Offloader.stats` counts what
moved (tensors, device bytes freed, host bytes held at the peak).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_leaves

from rematlab.exceptions import ConfigError

MIN_BYTES = 1 << 20  # below a MiB a copy's launch and pinning cost more than it frees


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class HostPool:
    """Host buffers reused by size: pinned when the device is CUDA (so copies are
    asynchronous), plain otherwise. A buffer given back with an event is reused only once
    the event has completed (its reload finished reading it)."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._free: dict[int, list[torch.Tensor]] = {}
        self._pending: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self.allocated = 0  # host bytes the pool holds, free or not
        self.allocations = 0

    def take(self, nbytes: int) -> torch.Tensor:
        self._collect()
        free = self._free.get(nbytes)
        if free:
            return free.pop()
        self.allocated += nbytes
        self.allocations += 1
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def give(self, buffer: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self._pending.append((buffer, event))

    def _collect(self) -> None:
        still = []
        for buffer, event in self._pending:
            if event is None or event.query():
                self._free.setdefault(buffer.numel(), []).append(buffer)
            else:
                still.append((buffer, event))
        self._pending = still


@dataclass
class OffloadStats:
    """What moved in the last step: tensors and their device bytes, and the most host bytes
    held at once (the pool's buffers in use)."""

    tensors: int = 0
    device_bytes: int = 0
    host_peak: int = 0
    host_now: int = 0

    def held(self, nbytes: int) -> None:
        self.host_now += nbytes
        self.host_peak = max(self.host_peak, self.host_now)


class _Moved:
    """One saved view's elements on the host: its buffer, the layer that saved it, how many
    saves share it, and (while reloaded) its device copy and the event the compute stream
    waits for. The host buffer goes back to the pool when autograd drops the last save of it
    (its graph freed), so a graph kept for a second backward can reload it again."""

    def __init__(self, host: torch.Tensor, like: torch.Tensor, layer: int,
                 device: torch.device) -> None:
        self.host = host
        self.like = like  # a meta tensor of the saved view: dtype, shape, strides
        self.layer = layer
        self.device = device
        self.saves = 1
        self.unpacked = 0
        self.reloaded: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None


@dataclass
class _Kept:
    tensor: torch.Tensor


@dataclass
class Offloader:
    """Offload for the layers of one model (module docstring). `resident`: the tensors that
    stay where they are whatever is saved (the model's parameters and buffers)."""

    resident: list[torch.Tensor]
    min_bytes: int = MIN_BYTES
    stats: OffloadStats = field(default_factory=OffloadStats)

    def __post_init__(self) -> None:
        if not isinstance(self.min_bytes, int) or isinstance(self.min_bytes, bool) \
                or self.min_bytes < 0:
            raise ConfigError(f"min_bytes must be a whole number of bytes >= 0, got "
                              f"{self.min_bytes!r}")
        self._resident = {_storage_key(t) for t in self.resident}
        device = next((t.device for t in self.resident), torch.device("cpu"))
        self.cuda = device.type == "cuda"
        self.pool = HostPool(pinned=self.cuda)
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._in_flight: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._layers: dict[int, weakref.WeakSet[_Moved]] = {}

    @classmethod
    def for_model(cls, model: nn.Module, min_bytes: int = MIN_BYTES) -> Offloader:
        return cls([*model.parameters(), *model.buffers()], min_bytes)

    @contextlib.contextmanager
    def layer(self, index: int, inputs: tuple = ()) -> Iterator[None]:
        """Run layer `index`'s forward with its saved tensors offloaded; `inputs` (its
        arguments' tensors) stay on the device."""
        kept = {_storage_key(t) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)}
        seen: dict[int, tuple[weakref.ref, _Moved]] = {}  # this forward's moved tensors
        with saved_tensors_hooks(lambda t: self._pack(t, index, kept, seen), self._unpack):
            yield
        self._settle(wait=False)

    # -- forward ------------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor, layer: int, kept: set,
              seen: dict[int, tuple[weakref.ref, _Moved]]) -> _Kept | _Moved:
        key = _storage_key(t)
        if (t.device.type == "meta" or t.is_sparse or t.numel() == 0 or key in self._resident
                or key in kept or t.untyped_storage().nbytes() < self.min_bytes
                or (not self.cuda and t.device.type != "cpu")):
            kept.add(key)  # a view of it elsewhere would free nothing: kept too
            return _Kept(t)
        ref, moved = seen.get(id(t), (None, None))
        if ref is not None and ref() is t and moved is not None:  # saved again: one copy
            moved.saves += 1
            return moved
        nbytes = t.numel() * t.element_size()
        host = self.pool.take(nbytes)
        if self.cuda:
            assert self.stream is not None
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self.stream):
                host.view(t.dtype).copy_(t.detach().reshape(-1), non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.stream)
            self._in_flight.append((t, done))  # alive until its copy has read it
        else:
            host.view(t.dtype).copy_(t.detach().reshape(-1))
        moved = _Moved(host, torch.empty_like(t, device="meta"), layer, t.device)
        weakref.finalize(moved, self._released, host, nbytes)
        seen[id(t)] = (weakref.ref(t), moved)  # by identity: a freed tensor's id is reused
        self._layers.setdefault(layer, weakref.WeakSet()).add(moved)
        self.stats.tensors += 1
        self.stats.device_bytes += nbytes
        self.stats.held(nbytes)
        self._settle(wait=False)
        return moved

    def _settle(self, wait: bool) -> None:
        """Drop the device tensors whose copies have completed (all of them with `wait`,
        the compute stream waiting for each copy first)."""
        still = []
        for tensor, done in self._in_flight:
            if wait:
                torch.cuda.current_stream(tensor.device).wait_event(done)
            elif not done.query():
                still.append((tensor, done))
        self._in_flight = still

    def _released(self, host: torch.Tensor, nbytes: int) -> None:
        """A moved view's last save is gone: its host buffer back to the pool, once any
        reload still reading it is done (`HostPool.give`)."""
        self.stats.host_now -= nbytes
        if self.stream is None:
            self.pool.give(host, None)
            return
        event = torch.cuda.Event()
        event.record(self.stream)  # every reload queued so far has read its buffer by then
        self.pool.give(host, event)

    # -- backward -----------------------------------------------------------------------------

    def _unpack(self, packed: _Kept | _Moved) -> torch.Tensor:
        if isinstance(packed, _Kept):
            return packed.tensor
        if packed.reloaded is None:
            self._settle(wait=True)  # forward is over: every copy is waited for
            self._reload(packed.layer)
            self._reload(packed.layer - 1)  # the next layer backward reaches, a layer ahead
            if packed.reloaded is None:  # a graph kept for a second backward
                self._reload_one(packed)
        if packed.ready is not None:
            torch.cuda.current_stream(packed.device).wait_event(packed.ready)
        tensor = packed.reloaded
        assert tensor is not None
        packed.unpacked += 1
        if packed.unpacked % packed.saves == 0:  # every save of it has its tensor: drop ours
            packed.reloaded = packed.ready = None
        return tensor

    def _reload(self, layer: int) -> None:
        for moved in list(self._layers.get(layer, ())):
            if moved.reloaded is None:
                self._reload_one(moved)

    def _reload_one(self, moved: _Moved) -> None:
        like = moved.like
        out = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype,
                                  device=moved.device)
        source = moved.host.view(like.dtype).view(like.shape)  # the view's logical order
        if self.cuda:
            assert self.stream is not None
            self.stream.wait_stream(torch.cuda.current_stream(moved.device))  # `out` allocated
            with torch.cuda.stream(self.stream):
                out.copy_(source, non_blocking=True)
                moved.ready = torch.cuda.Event()
                moved.ready.record(self.stream)
        else:
            out.copy_(source)
        moved.reloaded = out


class OffloadedLayers:
    """`layers` of a model run with their saved tensors offloaded (`Offloader.layer`), by
    forward hooks: the pre-hook enters the layer's hooks, the post-hook (called even when the
    forward raises) leaves them, so a failed forward leaves no hooks behind. `remove()` takes
    them off; `offloader.stats` says what moved."""

    def __init__(self, model: nn.Module, layers: list[nn.Module],
                 min_bytes: int = MIN_BYTES) -> None:
        if not layers or not all(isinstance(m, nn.Module) for m in layers):
            raise ConfigError("offload needs a non-empty list of the model's layers")
        owned = {id(m) for m in model.modules()}
        if any(id(m) not in owned for m in layers):
            raise ConfigError("offload: every layer must be a submodule of the model")
        self.offloader = Offloader.for_model(model, min_bytes)
        self._open: list[contextlib.ExitStack] = []
        self._handles = []
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(
                lambda _m, args, kwargs, i=i: self._enter(i, args, kwargs), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(
                lambda *_: self._leave(), always_call=True))

    def _enter(self, index: int, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            self._open.append(contextlib.ExitStack())  # nothing is saved: nothing to move
            return
        stack = contextlib.ExitStack()
        stack.enter_context(self.offloader.layer(index, (*args, *kwargs.values())))
        self._open.append(stack)

    def _leave(self) -> None:
        self._open.pop().close()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
