"""The costs of a model that runs its own layer loop, as a chain of pseudo-blocks [before,
layer 1..L, after] (see `rematlab.remat.layers`): each layer profiled on the arguments captured
from a real forward, and what runs before the first layer and after the last read from one
tracked training step of the whole model (`outer_costs`).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from rematlab.core.batch import Batch, batch_bytes, tensors, to_device
from rematlab.core.probes import rounded
from rematlab.core.recipe import Step
from rematlab.core.steps import is_oom, preserved
from rematlab.core.timer import profile_timer, timed, watched
from rematlab.plans.fixed import none_plan
from rematlab.plans.offload import with_offload
from rematlab.plans.plan import ChainCosts, Plan, Selective
from rematlab.preflight.fake import FakeSession
from rematlab.preflight.shared import model_key, shared
from rematlab.preflight.targets import Target
from rematlab.remat.block import BlockCost, profile_block
from rematlab.remat.chain import Repeats, block_input, cuda_target, optimizer_memory
from rematlab.remat.compiled_menu import MenuBlock, block_menu
from rematlab.remat.layers import LayerCall, LayerRemat, attach, capture
from rematlab.remat.offload_costs import link_for, metered_offloads
from rematlab.remat.ops import OPTION_REPEATS
from rematlab.remat.outer import OuterCost, one_pass, outer_costs, output_tensor, step_time
from rematlab.remat.profiling import Profiling
from rematlab.remat.shorten import shortened, stretched

_log = logging.getLogger("rematlab")


def profile_layers(model: nn.Module, batch: Batch, layers: list[nn.Module],
                   how: Profiling | None = None) -> ChainCosts:
    """Costs of the pseudo-block chain [before, layer 1..L, after] (see module docstring)
    for `how.step`, measured on the batch's device; with `how.compile`, each layer's costs
    are those of the layer compiled (what the model around it does is measured eager, and
    the plan's compiled step is verified whole). With `how.target`, the model (real or on
    the meta device) and the batch (real or meta tensors) are profiled as fake twins
    (`rematlab.preflight`): bytes as a real run's, times the roofline's on the target;
    nothing is allocated or run. Inside `rematlab.preflight.shared.shared_runs()`, a fake
    run already made for a target of the same kind is priced again, not run again."""
    how = how or Profiling()
    target = how.target
    if target is None:
        return _costs(_profiled(model, batch, layers, how), _Sizes.of(model, batch, how), how)
    names = {id(m): n for n, m in model.named_modules()}

    def fake_run() -> tuple[_Profiled, _Sizes]:  # the twin made only when the run is
        session = FakeSession(cuda=target.kind == "cuda")
        twin = session.model(model)
        with session.active():
            fakes = session.batch(batch)
            found = _profiled(twin, fakes, [twin.get_submodule(names[id(m)]) for m in layers],
                              replace(how, repeats=0, compile=False))
            return found, _Sizes.of(twin, fakes, how)
    found, sizes = shared(_shared_key(model, batch, layers, how, names), fake_run)
    return _costs(found, sizes, how)


def _shared_key(model: nn.Module, batch: Batch, layers: list[nn.Module], how: Profiling,
                names: dict[int, str]) -> tuple | None:
    """What a fake profile depends on (`rematlab.preflight.shared`): the model, batch and
    step, the layers' names, and the target's kind, allocation unit and calibration; None
    for op-level menus, whose options are priced as they are made."""
    if how.ops or how.offload or how.target is None:  # menus priced as they are made
        return None
    return ("profile", model_key(model, batch, how.step), tuple(names.get(id(m)) for m in layers),
            how.target.kind, how.target.unit, how.target.calibrated)


@dataclass(frozen=True)
class _Profiled:
    """What one profile ran: the layers' rows and the outer costs of the model, or of its
    three-layer twin (`shorten`) with the four-layer twin's (`longer`) and the layers to
    stretch them to, and the last layer's output bytes. A predicted one keeps its ops, so
    it is priced for any card of its kind (`priced`)."""

    rows: list[BlockCost]
    outer: OuterCost
    longer: OuterCost | None
    stretch_to: int | None
    out_bytes: int

    def priced(self, target: Target | None) -> tuple[list[BlockCost], OuterCost]:
        """The rows and outer costs, fresh copies (the chain's assembly adds to them), their
        times priced on `target` when predicted."""
        rows = [r.priced(target) if target is not None else replace(r) for r in self.rows]
        outer, longer = ((o.priced(target) if target is not None else replace(o))
                         if o is not None else None for o in (self.outer, self.longer))
        if self.stretch_to is not None:
            return stretched(rows, outer, longer, self.stretch_to)  # type: ignore[arg-type]
        return rows, outer  # type: ignore[return-value]


def _profiled(model: nn.Module, batch: Batch, layers: list[nn.Module], how: Profiling
              ) -> _Profiled:
    with watched("the layers' forward and backward times") if how.target is None \
            else contextlib.nullcontext():
        # short twins where the layers are alike (`shorten`), the whole model otherwise
        found = _shortened_run(model, batch, layers, how)
        if found is None:
            rows, outer = _run(model, batch, layers, how)
            found = _Profiled(rows, outer, None, None, 0)
    return replace(found, out_bytes=rounded(found.rows[-1].out.untyped_storage().nbytes(),
                                            how.unit))


@dataclass(frozen=True)
class _Sizes:
    """What the chain's costs take of the model and batch beyond the profile: the optimizer
    state and its phase's transient peak, the parameters' (and buffers') bytes, the
    gradients', the batch's, and the batch's device. A fake run keeps them with its
    profile, so a card priced from a shared run needs no fake twin of its own."""

    state: int
    transient: int
    params: int
    grads: int
    inputs: int
    device: torch.device

    @classmethod
    def of(cls, model: nn.Module, batch: Batch, how: Profiling) -> _Sizes:
        unit = how.unit
        state, transient = optimizer_memory(list(model.parameters()), how.step, unit,
                                            cuda_target(how.target))
        return cls(state, transient,
                   params=sum(rounded(t.numel() * t.element_size(), unit)
                              for t in [*model.parameters(), *model.buffers()]),
                   grads=sum(rounded(p.numel() * p.element_size(), unit)
                             for p in model.parameters() if p.requires_grad),
                   inputs=batch_bytes(batch, unit), device=next(tensors(batch)).device)


def _costs(profiled: _Profiled, sizes: _Sizes, how: Profiling) -> ChainCosts:
    """The chain's costs from what the profile ran, priced on `how.target`."""
    target, step = how.target, how.step
    rows, outer = profiled.priced(target)
    # the step's time outside the layers: what no plan changes, so predicted times are steps
    outside = max(0.0, outer.step_time - sum(r.fwd_time + r.bwd_time for r in rows))
    x = [0, *(r.x for r in rows), profiled.out_bytes, 0]
    state, transient, params, grads, inputs = (sizes.state, sizes.transient, sizes.params,
                                               sizes.grads, sizes.inputs)
    _add_held(rows, x, outer.layer_live)

    def column(key: str, first: Any, last: Any) -> list:
        return [first, *(getattr(r, key) for r in rows), last]

    costs = ChainCosts(
        x=x,
        saved=column("saved", outer.before_saved, outer.after_saved),
        keeps_input=column("keeps_input", False, outer.after_keeps_input),
        keeps_output=column("keeps_output", False, False),
        fwd_mem=column("fwd_mem", outer.before_fwd, outer.after_fwd),
        rec_mem=column("rec_mem", outer.before_fwd, outer.after_fwd),
        bwd_mem=column("bwd_mem", outer.before_bwd, outer.after_bwd),
        grad=column("grad", outer.before_grad, outer.after_grad),
        fwd_time=column("fwd_time", 0.0, 0.0),
        bwd_time=column("bwd_time", outside, 0.0),
        fwd_flops=column("fwd_flops", 0.0, 0.0),
        options=[[], *(r.options for r in rows), []],
        cast=column("cast", 0, 0) if step.autocast is not None else [],
        grads_resident=step.grads_resident,
        base=params + state + inputs + outer.output + outer.loss
        + (grads if step.grads_resident else 0),
        state=state,
        # the loss, and the output where the loop holds it to the step's end, are still alive
        optimizer_peak=params + grads + state + transient + inputs + outer.loss
        + (outer.output if step.output_to_end else 0),
        **(_ranges(rows, outer) if target is not None else {}),
    )
    if not how.offload:
        return costs
    return with_offload(costs, column("offload", [], []), link_for(sizes.device, target))


def _add_held(rows: list[BlockCost], x: list[int], live: list[int]) -> None:
    """What a kept layer holds beyond its saved tensors (a key/value cache, hooks keeping
    outputs), added to its saved bytes: the live bytes each layer added in the real step
    (`live`), less what its profile explains. A checkpointed layer holds none of it (caches
    are not passed to it)."""
    for i, r in enumerate(rows):
        explained = r.saved + x[i + 2] - (0 if r.keeps_input or i == 0 else r.x)
        r.saved += max(0, live[i + 1] - live[i] - explained)


def _ranges(rows: list[BlockCost], outer: OuterCost) -> dict[str, list]:
    """A predicted layer chain's range columns: the layers' own, and the step's time outside
    the layers at each end of the predicted interval (in the first pseudo-block's backward,
    as its typical time); the outer pseudo-blocks are never checkpointed."""
    outside = tuple(max(0.0, outer.step_range[end] - sum(
        r.fwd_range[end] + r.bwd_range[end] for r in rows)) for end in (0, 1))
    return {"fwd_range": [(0.0, 0.0), *(r.fwd_range for r in rows), (0.0, 0.0)],
            "bwd_range": [outside, *(r.bwd_range for r in rows), (0.0, 0.0)],
            "checkpoint_time": [0.0, *(r.checkpoint_time for r in rows), 0.0],
            "checkpoint_range": [(0.0, 0.0), *(r.checkpoint_range for r in rows),
                                 (0.0, 0.0)]}


def _run(model: nn.Module, batch: Batch, layers: list[nn.Module], how: Profiling
         ) -> tuple[list[BlockCost], OuterCost]:
    """Each layer's profile (identical layers once, `Repeats`) and the outer costs."""
    device = next(tensors(batch)).device
    repeated = Repeats()
    with how.step.autocast_region(device):  # the arguments each layer gets in the step
        calls = capture(model, batch, layers)
    rows = [_profile_layer(layer, host_call, device, repeated, how)
            for layer, host_call in zip(layers, calls, strict=True)]
    in_step = how.ops and how.target is None and how.repeats > 0 and not how.compile
    # with op-level menus the all-kept step is timed side by side with the all-option one
    # (`_options_in_step`), so the outer costs do not time it again
    outer = outer_costs(model, batch, layers, how.step, 0 if in_step else how.repeats,
                        how.target)
    if in_step:
        rows, kept = _options_in_step(model, batch, layers, rows, how.step)
        outer.step_time = kept if kept is not None else step_time(
            attach(model, LayerRemat(layers, none_plan(len(layers) + 2))), batch, how.step,
            how.repeats)
    return rows, outer


def _options_in_step(model: nn.Module, batch: Batch, layers: list[nn.Module],
                     rows: list[BlockCost], step: Step
                     ) -> tuple[list[BlockCost], float | None]:
    """The layers' options with the time they take in a step. A layer profiled alone under
    selective checkpointing can cost far less than it does between other layers (on this
    CPU a Llama-style layer's "save mm×7, bmm×2" profiled at +7-9 ms and took +18-20 ms in the
    step, most of it in the forward), and an option priced too cheap is chosen over a
    whole-layer checkpoint that is faster. So the step with every layer kept and the step
    with every layer under its first option are timed side by side (interleaved rounds, by
    the one timer), and each option's time beyond its plain layer is scaled by the measured
    extra over the profiled one; never scaled down, since the profile's own lower bounds
    (`ops.block_options`) already hold. Also returns the all-kept step's median seconds (the
    profile's step time), None when no option costs more than its layer and nothing was
    timed."""
    menus = [r.options for r in rows]
    predicted = sum(m[0].fwd_time + m[0].bwd_time - r.fwd_time - r.bwd_time
                    for r, m in zip(rows, menus, strict=True) if m)
    if predicted <= 0:
        return rows, None
    n = len(layers) + 2
    optioned = Plan(n, (0, *(Selective.of(i, m[0]) if m else i
                             for i, m in enumerate(menus, start=1)), n - 1))
    runs = {name: attach(model, LayerRemat(layers, plan))
            for name, plan in (("kept", none_plan(n)), ("options", optioned))}
    with preserved(model):
        timing = profile_timer(next(tensors(batch)).device).run(
            {name: timed(lambda run=run: one_pass(model, run, batch, step))
             for name, run in runs.items()}, OPTION_REPEATS, warmup=0)
    scale = max(1.0, (timing.median("options") - timing.median("kept")) / predicted)

    def scaled(row: BlockCost) -> BlockCost:
        plain = row.fwd_time + row.bwd_time
        return replace(row, options=[
            replace(o, bwd_time=o.bwd_time + (scale - 1) * (o.fwd_time + o.bwd_time - plain))
            for o in row.options])
    return [scaled(r) for r in rows], timing.median("kept")


def _shortened_run(model: nn.Module, batch: Batch, layers: list[nn.Module], how: Profiling
                   ) -> _Profiled | None:
    """`_run` through the three-layer twin (`rematlab.remat.shorten`), and pre-flight the
    four-layer twin's step time; None where they do not apply, or where the model's loop
    does not run a shortened layer list (one that indexes its layers by the config's count):
    the whole model's run then reports any error that is real. Running out of memory is
    passed on as it is: a result (the device cannot profile this batch), not a reason to run
    the larger whole model."""
    try:
        with shortened(model, layers) as short:
            if short is None:
                return None
            rows, outer = _run(model, batch, short, how)
        longer = None
        if how.target is not None:
            with shortened(model, layers, keep=4) as four:
                longer = outer_costs(model, batch, four, how.step, 0, how.target)
    except Exception as exc:  # see the docstring: the whole model's run decides
        if is_oom(exc):
            raise
        _log.debug("profiled whole: the shortened twin failed (%s: %s)", type(exc).__name__,
                   exc)
        return None
    return _Profiled(rows, outer, longer, len(layers), 0)


def _profile_layer(layer: nn.Module, host_call: LayerCall, device: torch.device,
                   repeated: Repeats, how: Profiling) -> BlockCost:
    """One layer's costs, profiled on the arguments it received in the real forward (or
    those of an identical layer profiled before it, `Repeats`), its forward in the step's
    autocast region."""
    lc = LayerCall(to_device(host_call.args, device), to_device(host_call.kwargs, device),
                   host_call.where)
    x_in = block_input(lc.hidden(), needs_grad=True)

    def layer_run(x: torch.Tensor) -> torch.Tensor:
        args, kwargs = lc.with_hidden(x)
        return output_tensor(layer(*args, **kwargs))

    run = how.step.in_region(layer_run, device)
    inputs = [x_in, *lc.others()]
    row = repeated.costs(layer, inputs, lambda: run(x_in))
    if row is None:
        with preserved(layer):
            row = profile_block(layer, x_in, how.repeats, run=run, others=lc.others(),
                                compile=how.compile, target=how.target, unit=how.unit)
        if how.ops:
            with preserved(layer):
                row.options = block_menu(
                    MenuBlock(layer, run, x_in, lc.others(), type(layer).__name__), row, how)
        if how.offload:
            row.offload = metered_offloads(layer, run, x_in, lc.others(), row,
                                           link_for(device, how.target), how.unit)
        repeated.remember(layer, inputs, row)
    return replace(row)
