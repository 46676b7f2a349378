"""Each block of a chain gets its costs.

`profile_chain` runs every block once forward and backward with the live-tensor tracker:
input/output bytes, saved bytes (parameters excluded), the transient peaks of forward,
backward and of a recomputation (which stops at the last saved tensor), parameter-gradient
bytes, FLOPs, and — on a real device — median times; then the loss on the chain's output.
There the transient peaks are also read from the allocator (`probes.allocator_trace`), which
sees the scratch buffers kernels allocate inside an op; the larger figure is kept. With
`compile`, each block also runs under `torch.compile` and its memory and times are replaced
by what the compiled block saves, allocates and takes (inductor fuses kernels and saves
different tensors; only the allocator and saved-tensor hooks see inside compiled code). For a
`target` (pre-flight, `rematlab.preflight`) the blocks run as fake twins: the same bytes,
nothing allocated, times from the target's roofline. On the `meta` device nothing is computed
and times are replaced by FLOPs (what the study's analytic features use).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from rematlab.core import flops as flop_count
from rematlab.core.batch import Batch, batch_bytes, one_tensor, tensors, to_device
from rematlab.core.probes import (
    LiveTensorTracker,
    rounded,
)
from rematlab.core.recipe import Step
from rematlab.core.steps import loss_of, preserved, runs_on
from rematlab.core.timer import watched
from rematlab.exceptions import ConfigError
from rematlab.plans.plan import ChainCosts
from rematlab.preflight.fake import FakeSession, is_fake
from rematlab.preflight.targets import Target
from rematlab.remat.block import COMPILED_FIELDS, BlockCost, compiling, profile_block
from rematlab.remat.compiled_menu import MenuBlock, block_menu
from rematlab.remat.profiling import COMPILED_NOT_PREDICTED, Profiling
from rematlab.remat.tracing import meta_copy


def profile_chain(blocks: list[nn.Module], example_input: Batch, how: Profiling | None = None,
                  device: torch.device | None = None) -> ChainCosts:
    """Per-block costs at the example input's batch size (see module docstring), for
    `how.step` (`rematlab.core.recipe`): blocks run forward in its autocast region, the
    optimizer phase is its; every allocation is rounded up to the allocator's block size
    (512 for CUDA predictions). With `how.ops`, each block also gets its menu of op-level
    options (`rematlab.remat.ops`). With `how.target`, the blocks and the input are fake twins
    (`rematlab.preflight`): bytes as a real run's, times the roofline's on the target;
    nothing is allocated or run. On the meta `device`, FLOPs stand for times.
    `example_input` is the chain's input tensor, or under the user's step function
    (`step.fn`) the batch the function takes, which it runs (`chain_input`,
    `step_fn_excess`)."""
    how = how or Profiling()
    step, target, unit = how.step, how.target, how.unit
    device = device or next(tensors(example_input)).device
    meta = device.type == "meta" and target is None  # a target prices meta batches as fakes
    predicted = meta or target is not None
    _check(how, meta, predicted)
    session = FakeSession(cuda=target.kind == "cuda") if target is not None else None
    run, batch = _runnable(blocks, example_input, device, session, meta)
    watch = (session.active() if session is not None else contextlib.nullcontext() if meta
             else watched("the blocks' forward and backward times"))
    with watch:
        x = first = chain_input(nn.Sequential(*run), batch, step,
                                "the model (pre-flight)" if session is not None else None)
        # resident: the chain's input, and under a step function the rest of its batch too
        # (labels, targets), each storage once
        base_input = (batch_bytes((batch, x), unit) if step.fn is not None
                      else rounded(x.element_size() * x.numel(), unit))
        rows = _blocks_costs(run, x, how, timed=not predicted)
        x = rows[-1].out
        out_bytes = rounded(x.element_size() * x.numel(), unit)
        state, transient = optimizer_memory([p for b in run for p in b.parameters()],
                                            step, unit, cuda_target(target))
        peak, loss_bytes = loss_peak(x, first, step, unit)
        beyond = step_fn_excess(nn.Sequential(*run), batch, first, step, unit)
    grads, params_bytes = sum(r.grad for r in rows), sum(r.params for r in rows)
    cols = columns(rows, predicted=target is not None, autocast=step.autocast is not None)
    cols["x"].append(out_bytes)
    cols["keeps_output"][-1] = False  # the output is alive all step: counted in `base`
    if meta:  # FLOPs stand for times (forward once, backward twice)
        cols["fwd_time"] = [r.fwd_flops for r in rows]
        cols["bwd_time"] = [2.0 * r.fwd_flops for r in rows]
    return ChainCosts(
        **cols,
        grads_resident=step.grads_resident,
        # the output and the loss (alive until the step ends, as in a user's loop), the
        # gradient backward starts from (alive until it ends), and the output's gradient
        # (from the loss's backward until the last block's, then the next gradient's place);
        # every gradient when they are resident
        base=params_bytes + state + base_input + 2 * out_bytes + 2 * loss_bytes
        + (grads if step.grads_resident else 0) + beyond,
        loss_mem=peak - out_bytes - 2 * loss_bytes,
        state=state,
        # the output and the loss are still alive in the user's loop
        optimizer_peak=params_bytes + grads + state + transient + base_input + out_bytes
        + loss_bytes + beyond,
    )


def _check(how: Profiling, meta: bool, predicted: bool) -> None:
    """What a chain cannot be profiled for: compiled costs are measured; op-level options
    are profiled on tensors with data or a target's fakes, not on the meta device."""
    if predicted and how.compile:
        raise ConfigError(COMPILED_NOT_PREDICTED)
    if how.ops and meta:
        raise ConfigError("op-level options are profiled: not on the meta device (use a "
                          "target)")


def _blocks_costs(run: list[nn.Module], x: torch.Tensor, how: Profiling, timed: bool
                  ) -> list[BlockCost]:
    """Each block's costs, in order, each on the output of the one before it (identical
    blocks profiled once, `Repeats`)."""
    repeated = Repeats()
    rows: list[BlockCost] = []
    for i, block in enumerate(run):
        x_in = block_input(x, needs_grad=i > 0)
        fwd = how.step.in_region(block, x_in.device)
        r = repeated.costs(block, [x_in], lambda fwd=fwd, x_in=x_in: fwd(x_in))
        if r is None:
            r = _chain_block(block, x_in, fwd, how, timed)
            repeated.remember(block, [x_in], r)
        rows.append(r)
        x = r.out
    return rows


def columns(rows: list[BlockCost], predicted: bool, autocast: bool) -> dict[str, list]:
    """The `ChainCosts` columns of blocks' costs, in order: the ranges only when
    `predicted`, the weight copies only under `autocast`."""
    keys = ["x", "saved", "keeps_input", "keeps_output", "fwd_mem", "rec_mem", "bwd_mem", "grad",
            "fwd_time", "bwd_time", "fwd_flops", "options"]
    keys += ["fwd_range", "bwd_range", "checkpoint_time", "checkpoint_range"] if predicted \
        else []
    keys += ["cast"] if autocast else []
    return {key: [getattr(r, key) for r in rows] for key in keys}


def _runnable(blocks: list[nn.Module], batch: Batch, device: torch.device,
              session: FakeSession | None, meta: bool) -> tuple[list[nn.Module], Batch]:
    """The blocks and the batch a chain is profiled on: fake twins for a target's
    `session`, meta copies on the meta device, else the blocks themselves and the batch on
    `device`."""
    if session is not None:
        return [session.model(b) for b in blocks], session.batch(batch)
    return [meta_copy(b) for b in blocks] if meta else blocks, to_device(batch, device)


def _chain_block(block: nn.Module, x_in: torch.Tensor, fwd: Callable, how: Profiling,
                 timed: bool) -> BlockCost:
    """One block's profile in a chain: eager (`profile_block`; timed unless predicted), with
    what compiling it changes measured compiled (`block.COMPILED_FIELDS`), and its op-level
    menu (`how.ops`)."""
    repeats, unit = how.repeats, how.unit
    with preserved(block):
        r = profile_block(block, x_in, repeats=repeats if timed else 0, unit=unit, run=fwd,
                          target=how.target)
    if how.compile:
        with preserved(block), compiling():
            c = profile_block(block, x_in, repeats, unit, run=fwd, compile=True)
        r = replace(r, **{k: getattr(c, k) for k in COMPILED_FIELDS})
    if how.ops:
        with preserved(block), compiling() if how.compile else contextlib.nullcontext():
            r.options = block_menu(MenuBlock(block, fwd, x_in), r, how)
    return r


def chain_input(twin: nn.Sequential, batch: Batch, step: Step, check: str | None
                ) -> torch.Tensor:
    """The tensor the chain's first block takes: the batch, or under a step function what
    the function passes to the model, caught on the way in during one run of it without
    gradients (the model's state restored). `check` names the model when the batch must be
    tried on it first (pre-flight: a batch the model cannot take is bad input, said once)."""
    if step.fn is None:
        x = one_tensor(batch)
        if check is not None:
            runs_on(twin, twin, x, check)
        return x
    seen: list[torch.Tensor] = []
    hook = twin[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0])
                                             if not seen else None)
    try:
        with torch.no_grad(), preserved(twin):
            step.forward(twin, batch)
    finally:
        hook.remove()
    if not seen or not isinstance(seen[0], torch.Tensor):
        raise ConfigError("the step function never ran the model on a tensor: it must call "
                          "model(x) (a chain takes one tensor)")
    return seen[0].detach()


def step_fn_excess(twin: nn.Sequential, batch: Batch, first: torch.Tensor, step: Step,
                   unit: int) -> int:
    """Bytes a user's step function holds beyond rematlab's own step on the same chain
    (a teacher's output, a regulariser's temporaries, a second forward): one micro-batch of
    each, every block kept, both metered alike; 0 without a step function. The chain's costs
    carry them through the whole step, which is exact for the plan that keeps everything and
    on the safe side for the others (when the function holds them is not known)."""
    if step.fn is None:
        return 0

    def peak(own: Step, given: Batch) -> int:
        tracker = LiveTensorTracker(unit=unit)
        with preserved(twin):
            tracker.track([*twin.parameters(), *twin.buffers(), *tensors(batch), first])
            before = tracker.live
            with tracker:
                own.micro_batch(twin, given)
        return tracker.peak - before
    return max(0, peak(step, batch) - peak(replace(step, fn=None), first))


def loss_peak(out: torch.Tensor, batch: torch.Tensor, step: Step, unit: int
              ) -> tuple[int, int]:
    """The peak of the loss's forward and backward above what is live before it (the
    output), its gradient included, and the loss's own bytes: the step's loss (the user's,
    or `default_loss`; a step function's own is measured when the plan is verified) in its
    autocast region, measured, because what it saves differs (cross-entropy keeps a
    log-softmax as large as the output, the mean square nothing beyond the output)."""
    y = out.detach().requires_grad_()
    tracker = LiveTensorTracker(unit=unit)
    tracker.track([y, batch])
    before = tracker.live
    with tracker:
        with step.autocast_region(y.device):
            loss = loss_of(y, batch, step.loss_fn)
        loss.backward()
    return tracker.peak - before, rounded(loss.element_size() * loss.numel(), unit)


class Repeats:
    """Costs of blocks already profiled, by structure: a repeated block (a transformer's
    layers, a ResNet stage's, the identical blocks of a deep chain) is profiled once and its
    costs shared. Sharing measured times, rather than timing every copy, also gives the copies
    *equal* costs, which lets the solver solve their sub-chains once (`solver.intern_subchains`).

    Two blocks are the same when their class, `repr`, training flag, parameter and buffer
    shapes, dtypes and `requires_grad`, and input shapes are; and, as a guard against a
    difference the `repr` does not show, when a forward of the second (no gradient) counts
    the same FLOPs and returns the same shape."""

    def __init__(self) -> None:
        self.rows: dict[tuple, BlockCost] = {}

    def costs(self, module: nn.Module, inputs: list[torch.Tensor],
              forward: Callable[[], torch.Tensor]) -> BlockCost | None:
        """The remembered costs of a block like `module` on `inputs` with `out` its own
        output of `forward()`, or None when it must be profiled."""
        row = self.rows.get(structure_key(module, inputs))
        if row is None:
            return None
        flops = flop_count.counter()
        with preserved(module), torch.no_grad(), flops:
            out = forward()
        if flops.get_total_flops() != row.fwd_flops or out.shape != row.out.shape:
            return None
        return replace(row, out=out)

    def remember(self, module: nn.Module, inputs: list[torch.Tensor], row: BlockCost
                 ) -> None:
        self.rows.setdefault(structure_key(module, inputs), row)


def structure_key(module: nn.Module, inputs: list[torch.Tensor]) -> tuple:
    """What makes two blocks the same for `Repeats` (and `shorten`): class, repr, training
    flag, parameter and buffer shapes and dtypes, and the inputs' shapes."""
    return (type(module).__qualname__, repr(module), module.training,
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                  for n, p in module.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers()),
            tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in inputs))


def block_input(x: torch.Tensor, needs_grad: bool) -> torch.Tensor:
    """A block's input as in a real step: the output of an op, not a leaf (a block may
    change its input in place, which autograd forbids on a leaf that requires grad)."""
    if not (needs_grad and x.is_floating_point()):
        return x.detach()
    return x.detach().requires_grad_().clone()


def cuda_target(target: Target | None) -> bool:
    return target is not None and target.kind == "cuda"


# fake or meta parameters' optimizer phase by their shapes, the step and the target's kind:
# what pricing one model for several cards (`rematlab rent`) would otherwise run each time
_SHAPED_OPTIMIZERS: dict[tuple, tuple[int, int]] = {}


def optimizer_memory(params: list[torch.Tensor], step: Step, unit: int = 1,
                     cuda: bool = False) -> tuple[int, int]:
    """Bytes of the step's optimizer state (and a GradScaler's) and the transient peak of its
    optimizer phase — unscaling, clipping and the update, as the user's step runs them —
    measured on tensors shaped like `params` on their device (meta costs nothing), with the
    optimizer made as for CUDA parameters when `cuda` (a CUDA target: `Step.make_optimizer`);
    (0, 0) without an optimizer. Without data (fake or meta parameters) the figures depend
    on shapes alone, and are kept per shapes and step."""
    shaped = bool(params) and (params[0].device.type == "meta" or is_fake(params[0]))
    if not shaped:
        return _optimizer_memory(params, step, unit, cuda)
    alone = replace(step, layout=None)  # the whole model's phase: a rank's is `planning.ranks`
    key = (tuple((tuple(p.shape), p.dtype, p.requires_grad, p.device.type) for p in params),
           json.dumps(alone.to_dict(), sort_keys=True, default=repr), step.optimizer, unit,
           cuda)
    if key not in _SHAPED_OPTIMIZERS:
        if len(_SHAPED_OPTIMIZERS) >= 64:
            _SHAPED_OPTIMIZERS.pop(next(iter(_SHAPED_OPTIMIZERS)))
        _SHAPED_OPTIMIZERS[key] = _optimizer_memory(params, step, unit, cuda)
    return _SHAPED_OPTIMIZERS[key]


def _optimizer_memory(params: list[torch.Tensor], step: Step, unit: int, cuda: bool
                      ) -> tuple[int, int]:
    trainable = [p for p in params if p.requires_grad]
    clones = [nn.Parameter(torch.zeros_like(p)) for p in trainable]
    for c in clones:
        c.grad = torch.zeros_like(c)
    opt = step.make_optimizer(clones, cuda=cuda)
    if opt is None:
        return 0, 0
    device = clones[0].device if clones else torch.device("cpu")
    scaler = step.make_scaler(device)
    if scaler is not None:
        scaler.scale(torch.ones((), device=device))  # makes its scale and growth tracker
    readable = bool(clones) and not (device.type == "meta" or is_fake(clones[0]))

    def phase() -> None:
        step.update(clones, opt, scaler, readable)

    tracker = LiveTensorTracker(unit=unit)
    tracker.track([*clones, *(c.grad for c in clones)])
    with tracker:
        phase()
    before = tracker.live
    state = before - sum(2 * rounded(c.numel() * c.element_size(), unit) for c in clones)
    tracker.reset_peak()
    with tracker:
        phase()
    return state, tracker.peak - before
