"""Saved activations moved to host memory during forward and back before backward needs them:
the third choice per layer beside keeping and recomputing (issue 61).

Built on `torch.autograd.graph.saved_tensors_hooks`, as `torch.autograd.graph.save_on_cpu`
and torchtune's `OffloadActivations` are, with what their users were bitten by made explicit:

- **What moves.** A tensor a layer saves for backward, at least `min_bytes`, on the device.
  Never a parameter or buffer (its storage stays on the device anyway; under FSDP2 the
  unsharded parameter a layer saves is a `Parameter` too, and a leaf that requires grad),
  never the layer's own
  inputs (the previous layer's output, alive beside it), never a view of a storage that stays
  on the device for another saved tensor (copying it frees nothing); a storage saved twice is
  copied once.
- **Copies off the compute stream.** On CUDA each device-to-host copy runs on a side stream
  that first waits for the compute stream, into a pinned host buffer from a pool (a
  `cudaHostAlloc` costs milliseconds: buffers are kept and reused by size). The device tensor
  is kept alive until its copy's event has completed, then dropped: the race behind
  torchtune #1867 (a tensor freed while its copy still read it) cannot happen. At the latest
  when the *next* layer's forward ends, the compute stream waits for the copies and the
  tensors go: a layer's copies overlap the next layer's forward, and never pile up behind a
  slow link. This is the bound pre-flight prices (`rematlab.plans.offload`): on a CPU, where
  the copies are synchronous, the tensors are kept exactly that long too, so that a fake or a
  CPU run meters what a GPU holds at most.
- **Reloads a layer ahead.** When backward first needs a layer's tensors, that layer's reloads
  and the previous layer's (backward runs layers in reverse) start on the side stream, so a
  run of offloaded layers reloads each under the backward of the one after it; the first of
  a run (the last offloaded layer) is reloaded by its own backward. The compute stream waits
  for a tensor's event before using it. A host buffer returns to the pool once its reload
  has completed.
- **On a CPU** host and device memory are one: the copies still run (the mechanism and its
  bookkeeping are tested there), synchronously, and save nothing; planning on a CPU offers no
  offload for that reason.

`Offloader.running(i)` is the context every layer's forward runs in (`layer(i)` moves, then
`forwarded(i)` as the forward ends); `Offloader.stats` counts what moved (tensors,
device bytes freed, host bytes held at the peak). A `meter` (the live-storage tracker) is
told which storages are host buffers, so that it counts device and host bytes apart.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_leaves

from rematlab.core.probes import LiveTensorTracker, storage_key
from rematlab.exceptions import ConfigError

MIN_BYTES = 1 << 20  # below a MiB a copy's launch and pinning cost more than it frees


class HostPool:
    """Host buffers reused by size: pinned for a CUDA tensor's copy (so copies are
    asynchronous), plain otherwise. A buffer given back with an event is reused only once
    the event has completed (its reload finished reading it)."""

    def __init__(self, meter: LiveTensorTracker | None = None) -> None:
        self.meter = meter
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = {}
        self._pending: list[tuple[torch.Tensor, bool, torch.cuda.Event | None]] = []
        self.allocated = 0  # host bytes the pool holds, free or not
        self.allocations = 0

    def take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        self._collect()
        free = self._free.get((nbytes, pinned))
        if free:
            return free.pop()
        self.allocated += nbytes
        self.allocations += 1
        with (self.meter.host_allocations() if self.meter is not None
              else contextlib.nullcontext()):
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def give(self, buffer: torch.Tensor, pinned: bool, event: torch.cuda.Event | None
             ) -> None:
        self._pending.append((buffer, pinned, event))

    def _collect(self) -> None:
        still = []
        for buffer, pinned, event in self._pending:
            if event is None or event.query():
                self._free.setdefault((buffer.numel(), pinned), []).append(buffer)
            else:
                still.append((buffer, pinned, event))
        self._pending = still


class _Storages:
    """A set of tensors' storages, by identity while they live: a key alone (an address, or
    a fake storage's id) is reused once its storage is freed, and a new activation would
    then pass for a kept one."""

    def __init__(self, tensors: Iterable[torch.Tensor] = ()) -> None:
        self._refs: dict[Hashable, weakref.ref] = {}
        for t in tensors:
            self.add(t)

    def add(self, t: torch.Tensor) -> None:
        self._refs[storage_key(t)] = weakref.ref(t.untyped_storage())

    def __contains__(self, t: object) -> bool:
        assert isinstance(t, torch.Tensor)
        ref = self._refs.get(storage_key(t))
        return ref is not None and ref() is t.untyped_storage()


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


@dataclass(frozen=True)
class _Layout:
    """A saved view's shape, strides and dtype: what its reload is allocated as (plain data,
    not a meta tensor, which a live-storage meter would count)."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


class _Moved:
    """One saved view's elements on the host: its buffer, the layer that saved it, how many
    saves share it, and (while reloaded) its device copy and the event the compute stream
    waits for. The host buffer goes back to the pool when autograd drops the last save of it
    (its graph freed), so a graph kept for a second backward can reload it again."""

    def __init__(self, host: torch.Tensor, like: _Layout, layer: int,
                 device: torch.device) -> None:
        self.host = host
        self.like = like
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
    stay where they are whatever is saved (the model's parameters and buffers); `meter`: a
    live-storage tracker told which storages are host buffers."""

    resident: list[torch.Tensor]
    min_bytes: int = MIN_BYTES
    meter: LiveTensorTracker | None = None
    stats: OffloadStats = field(default_factory=OffloadStats)

    def __post_init__(self) -> None:
        if not isinstance(self.min_bytes, int) or isinstance(self.min_bytes, bool) \
                or self.min_bytes < 0:
            raise ConfigError(f"min_bytes must be a whole number of bytes >= 0, got "
                              f"{self.min_bytes!r}")
        self._resident = _Storages(self.resident)
        self.pool = HostPool(self.meter)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # a side stream per GPU
        # device tensors whose copies may still read them: (tensor, event, layer)
        self._in_flight: list[tuple[torch.Tensor, torch.cuda.Event | None, int]] = []
        self._layers: dict[int, weakref.WeakSet[_Moved]] = {}
        self._backward_at: int | None = None  # the layer backward last unpacked for

    def metered_by(self, meter: LiveTensorTracker | None) -> None:
        """Tell `meter` which storages are host buffers from now on (a replay of the step)."""
        self.meter = self.pool.meter = meter

    @classmethod
    def for_model(cls, model: nn.Module, min_bytes: int = MIN_BYTES,
                  meter: LiveTensorTracker | None = None) -> Offloader:
        return cls([*model.parameters(), *model.buffers()], min_bytes, meter)

    @contextlib.contextmanager
    def layer(self, index: int, inputs: tuple = (), cap: int | None = None) -> Iterator[None]:
        """Run layer `index`'s forward with its saved tensors offloaded, in the order it
        saves them, up to `cap` bytes (None: all; a tensor that would pass it stays);
        `inputs` (its arguments' tensors) stay on the device."""
        kept = _Storages(t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor))
        seen: dict[int, tuple[weakref.ref, _Moved]] = {}  # this forward's moved tensors
        room = [cap]  # bytes this forward may still move
        with saved_tensors_hooks(lambda t: self._pack(t, index, kept, seen, room),
                                 self._unpack):
            yield
        self._settle(wait=False)

    @contextlib.contextmanager
    def running(self, index: int, inputs: tuple = (), cap: int | None = None,
                move: bool = True) -> Iterator[None]:
        """Layer `index`'s forward under this offloader: its saved tensors moved (`layer`)
        when `move`, and, once it ends, `forwarded` in any case. How a model's layers run
        (`OffloadedLayers`, a plan's `LayerRemat`)."""
        with self.layer(index, inputs, cap) if move else contextlib.nullcontext():
            yield
        self.forwarded(index)

    def forwarded(self, index: int) -> None:
        """Layer `index`'s forward has ended (whether its tensors moved or not): the copies
        of earlier layers are waited for, and their device tensors dropped."""
        self._settle(wait=True, before=index)

    # -- forward ------------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor, layer: int, kept: _Storages,
              seen: dict[int, tuple[weakref.ref, _Moved]], room: list[int | None]
              ) -> _Kept | _Moved:
        if (t.device.type == "meta" or t.is_sparse or t.numel() == 0 or t in self._resident
                or isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad)
                or t in kept or t.untyped_storage().nbytes() < self.min_bytes
                or t.device.type not in ("cpu", "cuda")):
            kept.add(t)  # a view of it elsewhere would free nothing: kept too
            return _Kept(t)
        ref, moved = seen.get(id(t), (None, None))
        if ref is not None and ref() is t and moved is not None:  # saved again: one copy
            moved.saves += 1
            return moved
        nbytes = t.numel() * t.element_size()
        if room[0] is not None:
            if nbytes > room[0]:
                kept.add(t)
                return _Kept(t)
            room[0] -= nbytes
        host = self.pool.take(nbytes, pinned=t.is_cuda)
        done = None
        if t.is_cuda:
            stream = self._stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                host.view(t.dtype).copy_(t.detach().reshape(-1), non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
        else:
            host.view(t.dtype).copy_(t.detach().reshape(-1))
        self._in_flight.append((t, done, layer))  # alive until its copy has read it
        moved = _Moved(host, _Layout(t.shape, t.stride(), t.dtype), layer, t.device)
        weakref.finalize(moved, self._released, host, nbytes, t.device)
        seen[id(t)] = (weakref.ref(t), moved)  # by identity: a freed tensor's id is reused
        self._layers.setdefault(layer, weakref.WeakSet()).add(moved)
        self.stats.tensors += 1
        self.stats.device_bytes += nbytes
        self.stats.held(nbytes)
        self._settle(wait=False)
        return moved

    def _settle(self, wait: bool, before: int | None = None) -> None:
        """Drop the device tensors whose copies have completed; with `wait`, also those of
        layers before `before` (all of them without it), the compute stream waiting for each
        copy first. A CPU copy has completed when it returns, but its tensor is dropped only
        when waited for: as late as a GPU may hold it (module docstring)."""
        still = []
        for tensor, done, layer in self._in_flight:
            if wait and (before is None or layer < before):
                if done is not None:
                    torch.cuda.current_stream(tensor.device).wait_event(done)
            elif done is None or not done.query():
                still.append((tensor, done, layer))
        self._in_flight = still

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _released(self, host: torch.Tensor, nbytes: int, device: torch.device) -> None:
        """A moved view's last save is gone: its host buffer back to the pool, once any
        reload still reading it is done (`HostPool.give`)."""
        self.stats.host_now -= nbytes
        if device.type != "cuda":
            self.pool.give(host, False, None)
            return
        event = torch.cuda.Event()
        event.record(self._stream(device))  # every reload queued so far has read it by then
        self.pool.give(host, True, event)

    # -- backward -----------------------------------------------------------------------------

    def _unpack(self, packed: _Kept | _Moved) -> torch.Tensor:
        if isinstance(packed, _Kept):
            return packed.tensor
        if packed.layer != self._backward_at:
            self._backward_at = packed.layer
            self._drop_after(packed.layer)
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

    def _drop_after(self, layer: int) -> None:
        """Backward has reached `layer`: the reloads of later layers are done with. A tensor
        saved twice but unpacked once (a gradient not needed) would otherwise keep its reload
        alive until the graph dies; autograd keeps what it still uses, and anything unpacked
        again is reloaded again."""
        for later, items in self._layers.items():
            if later > layer:
                for moved in list(items):
                    moved.reloaded = moved.ready = None

    def _reload(self, layer: int) -> None:
        self._settle(wait=True)  # a reload reads the host copy: it must be complete
        for moved in list(self._layers.get(layer, ())):
            if moved.reloaded is None:
                self._reload_one(moved)

    def _reload_one(self, moved: _Moved) -> None:
        like = moved.like
        out = torch.empty_strided(like.shape, like.stride, dtype=like.dtype,
                                  device=moved.device)
        source = moved.host.view(like.dtype).view(like.shape)  # the view's logical order
        if moved.device.type == "cuda":
            stream = self._stream(moved.device)
            stream.wait_stream(torch.cuda.current_stream(moved.device))  # `out` allocated
            with torch.cuda.stream(stream):
                out.copy_(source, non_blocking=True)
                moved.ready = torch.cuda.Event()
                moved.ready.record(stream)
        else:
            out.copy_(source)
        moved.reloaded = out


class OffloadedLayers:
    """`layers` of a model run with the saved tensors of those at `moved` (positions in
    `layers`; default all) offloaded (`Offloader.layer`), by forward hooks on every layer: the
    pre-hook enters a moved layer's hooks, the post-hook (called even when the forward raises)
    leaves them and tells the offloader the layer's forward ended (`Offloader.forwarded`), so
    a failed forward leaves no hooks behind. `active` (default: always) says whether a forward
    is one to offload (a plan's runner: only inside its model's forward). `remove()` takes the
    hooks off; `offloader.stats` says what moved."""

    def __init__(self, model: nn.Module, layers: list[nn.Module], min_bytes: int = MIN_BYTES,
                 moved: Collection[int] | None = None, meter: LiveTensorTracker | None = None,
                 active: Callable[[], bool] | None = None) -> None:
        if not layers or not all(isinstance(m, nn.Module) for m in layers):
            raise ConfigError("offload needs a non-empty list of the model's layers")
        owned = {id(m) for m in model.modules()}
        if any(id(m) not in owned for m in layers):
            raise ConfigError("offload: every layer must be a submodule of the model")
        self.moved = set(range(len(layers))) if moved is None else set(moved)
        if not self.moved <= set(range(len(layers))):
            raise ConfigError(f"offload: layers to move {sorted(self.moved)} are not all "
                              f"among the {len(layers)} layers")
        self.offloader = Offloader.for_model(model, min_bytes, meter)
        self._active = active or (lambda: True)
        self._open: list[contextlib.ExitStack | None] = []
        self._handles = []
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(
                lambda _m, args, kwargs, i=i: self._enter(i, args, kwargs), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(
                lambda *_: self._leave(), always_call=True))

    def _enter(self, index: int, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled() or not self._active():
            self._open.append(None)  # nothing is saved, or not under the plan: nothing moves
            return
        stack = contextlib.ExitStack()
        stack.enter_context(self.offloader.running(index, (*args, *kwargs.values()),
                                                   move=index in self.moved))
        self._open.append(stack)

    def _leave(self) -> None:
        stack = self._open.pop()
        if stack is not None:
            stack.close()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
