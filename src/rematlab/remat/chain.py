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
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from rematlab.core.probes import (
    CastRecorder,
    LiveTensorTracker,
    allocator_trace,
    rounded,
    storage_key,
)
from rematlab.core.recipe import Step
from rematlab.core.steps import LossFn, default_loss, preserved, runs_on, unit_loss
from rematlab.core.timer import time_block, watched
from rematlab.exceptions import ConfigError
from rematlab.plans.plan import ChainCosts
from rematlab.preflight.fake import FakeSession, is_fake
from rematlab.preflight.roofline import OpLog
from rematlab.preflight.targets import Target, backward_interval, interval
from rematlab.preflight.workspace import Scratch
from rematlab.remat.ops import block_options
from rematlab.remat.tracing import meta_copy


def profile_chain(
    blocks: list[nn.Module],
    example_input: torch.Tensor,
    device: torch.device | None = None,
    optimizer: str | None = "sgd",
    repeats: int = 3,
    unit: int = 1,
    compile: bool = False,
    ops: bool = False,
    target: Target | None = None,
    loss_fn: LossFn | None = None,
    step: Step | None = None,
) -> ChainCosts:
    """Per-block costs at the example input's batch size (see module docstring), for the
    user's `step` (`rematlab.core.recipe`; else rematlab's own with `optimizer` and
    `loss_fn`): blocks run forward in its autocast region, the optimizer phase is its; `unit`
    rounds every allocation up to the allocator's block size (512 for CUDA predictions).
    With `ops`, each block also gets its menu of op-level options (`rematlab.remat.ops`).
    With a `target`, the blocks and the input are fake twins (`rematlab.preflight`): bytes
    as a real run's, times the roofline's on the target; nothing is allocated or run."""
    device = device or example_input.device
    step = step or Step(optimizer=optimizer, loss_fn=loss_fn)
    meta = device.type == "meta" and target is None  # a target prices meta batches as fakes
    predicted = meta or target is not None
    if predicted and compile:
        raise ConfigError("compiled costs must be measured: they cannot be predicted")
    if ops and (meta or compile):
        raise ConfigError("op-level options are profiled eager: not on the meta device (use "
                          "a target), not under torch.compile (plan whole blocks with "
                          "compile=True)")
    session = FakeSession(cuda=target.kind == "cuda") if target is not None else None
    if session is not None:
        run, x, unit = [session.model(b) for b in blocks], session.batch(example_input), \
            target.unit
    else:
        run = [meta_copy(b) for b in blocks] if meta else blocks
        x = example_input.to(device)
    batch = x  # what the loss is given besides the output
    base_input = rounded(x.element_size() * x.numel(), unit)
    fields: dict[str, list] = {k: [] for k in (
        "x", "saved", "keeps_input", "keeps_output", "fwd_mem", "rec_mem", "bwd_mem", "grad",
        "fwd_time", "bwd_time", "fwd_flops", "options", "fwd_range", "bwd_range", "cast")}
    params_bytes = 0
    watch = (session.active() if session is not None else contextlib.nullcontext() if meta
             else watched("the blocks' forward and backward times"))
    repeated = Repeats()
    with watch:
        if session is not None:  # a batch the model cannot take is bad input, said in one line
            twin = nn.Sequential(*run)
            runs_on(twin, twin, x, "the model (pre-flight)")
        for i, block in enumerate(run):
            x_in = block_input(x, needs_grad=i > 0)
            fwd = step.in_region(block, x_in.device)
            r = repeated.costs(block, [x_in], lambda fwd=fwd, x_in=x_in: fwd(x_in))
            if r is None:
                with preserved(block):
                    r = profile_block(block, x_in, repeats=0 if predicted else repeats,
                                      unit=unit, run=fwd, target=target)
                if compile:
                    with preserved(block), compiling():
                        r.update({k: v for k, v in profile_block(block, x_in, repeats, unit,
                                                                 run=fwd, compile=True).items()
                                  if k in COMPILED_KEYS})
                if ops:
                    with preserved(block):
                        r["options"] = block_options(block, fwd, x_in, r, repeats=repeats,
                                                     unit=unit, target=target)
                repeated.remember(block, [x_in], r)
            r.setdefault("options", [])
            for key, value in r.items():
                if key in fields:
                    fields[key].append(value)
            params_bytes += r["params"]
            x = r["out"]
        fields["x"].append(rounded(x.element_size() * x.numel(), unit))
        if meta:
            fields["fwd_time"] = list(fields["fwd_flops"])
            fields["bwd_time"] = [2.0 * f for f in fields["fwd_flops"]]
        state, transient = optimizer_memory([p for b in run for p in b.parameters()],
                                            step, unit)
        peak, loss_bytes = loss_peak(x, batch, step, unit)
    out_bytes = fields["x"][-1]
    fields["keeps_output"][-1] = False  # the output is alive all step: counted in `base`
    if step.autocast is None:
        fields["cast"] = []
    grads = sum(fields["grad"])
    return ChainCosts(
        **fields,
        grads_resident=step.grads_resident,
        # the output and the loss (alive until the step ends, as in a user's loop), the
        # gradient backward starts from (alive until it ends), and the output's gradient
        # (from the loss's backward until the last block's, then the next gradient's place);
        # every gradient when they are resident
        base=params_bytes + state + base_input + 2 * out_bytes + 2 * loss_bytes
        + (grads if step.grads_resident else 0),
        loss_mem=peak - out_bytes - 2 * loss_bytes,
        state=state,
        # the output and the loss are still alive in the user's loop
        optimizer_peak=params_bytes + grads + state + transient + base_input + out_bytes
        + loss_bytes,
    )


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
            loss = (step.loss_fn or default_loss)(y, batch)
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
        self.rows: dict[tuple, dict] = {}

    def costs(self, module: nn.Module, inputs: list[torch.Tensor],
              forward: Callable[[], torch.Tensor]) -> dict | None:
        """The remembered costs of a block like `module` on `inputs` with `out` its own
        output of `forward()`, or None when it must be profiled."""
        row = self.rows.get(structure_key(module, inputs))
        if row is None:
            return None
        flops = FlopCounterMode(display=False)
        with preserved(module), torch.no_grad(), flops:
            out = forward()
        if flops.get_total_flops() != row["fwd_flops"] or out.shape != row["out"].shape:
            return None
        return {**row, "out": out}

    def remember(self, module: nn.Module, inputs: list[torch.Tensor], row: dict) -> None:
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


def _saved_recorder(block: nn.Module, unit: int, exclude: frozenset = frozenset()
                    ) -> tuple[dict, Callable]:
    """A saved-tensor pack hook that records the storages saved for backward, parameters,
    buffers and the storages in `exclude` left out, and the dict it fills (key -> bytes)."""
    params = {storage_key(p) for p in [*block.parameters(), *block.buffers()]} | exclude
    saved: dict[tuple[str, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in params:
            saved[key] = rounded(t.untyped_storage().nbytes(), unit)
        return t

    return saved, pack


def profile_block(block: nn.Module, x_in: torch.Tensor, repeats: int, unit: int = 1,
                  run: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  others: list[torch.Tensor] | None = None, compile: bool = False,
                  target: Target | None = None) -> dict:
    """Costs of one block on `x_in`, the one block profiler (chains and layers, eager and
    compiled). `run(x)` calls the block and returns its output tensor (a layer of a real model
    takes more arguments and may return a tuple); `others` are those other tensor arguments,
    whose storages are not the block's saved bytes. With `compile`, the block runs under
    `torch.compile` (warmed up first): the live-tensor tracker cannot see inside compiled
    code, so memory comes from the allocator and saved-tensor hooks alone, and FLOPs are
    left to the eager profile. With a `target`, the block is a fake twin
    (`rematlab.preflight`): its times are the roofline's for the ops it ran, as an interval."""
    if compile:
        run = compiled(run or block)
        for _ in range(2):  # compile forward and backward outside the measurement
            out = run(x_in)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
        del out
        for p in block.parameters():
            p.grad = None
    run = run or block
    exclude = frozenset(storage_key(t) for t in others or ())
    saved, pack = _saved_recorder(block, unit, exclude)
    tracker = LiveTensorTracker(unit=unit)
    # parameters, buffers and other arguments exist before the block runs: tracked up front,
    # so that views of them (a Linear's `weight.t()`) are not counted as new memory
    tracker.track([x_in, *block.parameters(), *block.buffers(), *(others or ())])
    counting = contextlib.nullcontext() if compile else tracker
    flops = FlopCounterMode(display=False)
    logs = (OpLog(), OpLog()) if target is not None else None
    priced = (lambda i: logs[i]) if logs else (lambda _: contextlib.nullcontext())
    here = target is not None and target.calibrated  # kernels' scratch, asked of the device
    scratch = (lambda: Scratch(tracker, target.kind)) if here else contextlib.nullcontext
    real = not (x_in.device.type == "meta" or is_fake(x_in))
    allocator = allocator_trace(x_in.device) if real else None
    phase = allocator.phase if allocator else lambda _: contextlib.nullcontext()
    bwd_mem = 0
    marks: list[int] = []  # the forward's running peak each time autograd saves a tensor
    region = getattr(run, "autocast_dtype", None)  # `Step.in_region`: autocast's dtype
    casts = (CastRecorder(block.parameters(), region, unit) if region and not compile
             else None)  # the weight copies autocast caches

    def pack_marked(t: torch.Tensor) -> torch.Tensor:
        marks.append(tracker.peak)
        return pack(t)

    with allocator or contextlib.nullcontext():
        before = tracker.live
        with phase("forward"), scratch(), counting, \
                flops if not compile else contextlib.nullcontext(), \
                torch.autograd.graph.saved_tensors_hooks(pack_marked, lambda t: t), priced(0), \
                casts or contextlib.nullcontext():
            out = run(x_in)
        fwd_mem = tracker.peak - before
        # a recomputation stops once the last saved tensor is made again (torch's early
        # stop), so the ops after it, the output among them, are not run
        rec_mem = (marks[-1] - before) if marks else 0
        kin, kout = storage_key(x_in), storage_key(out)
        nxt = out.detach().clone()  # the next block's input, made outside the tracker's view
        out_bytes = rounded(out.element_size() * out.numel(), unit)
        bwd_ran = out.requires_grad
        if bwd_ran:
            loss = unit_loss(out)  # `bwd_mem` is the peak above the output gradient
            del out  # autograd alone decides when the output dies, as in a real step
            before_bwd = tracker.live
            tracker.reset_peak()
            with phase("backward"), scratch(), counting, priced(1):
                loss.backward()
            bwd_mem = tracker.peak - before_bwd - out_bytes
    if allocator is not None:  # kernel workspaces, compiled code: only the allocator sees them
        if allocator.phases["forward"].transient > fwd_mem:  # unseen when: assume all of it
            fwd_mem = rec_mem = allocator.phases["forward"].transient
        if "backward" in allocator.phases:
            bwd_mem = max(bwd_mem, allocator.phases["backward"].transient - out_bytes)
    # the tracked run above was the warm-up (first kernels, compiled code already warmed)
    fwd_time, bwd_time = time_block(run, x_in, repeats) if repeats else (0.0, 0.0)
    ranges = {}
    if logs is not None:
        f_lo, fwd_time, f_hi = interval(logs[0].ops, target)
        b_lo, bwd_time, b_hi = (backward_interval(logs[1].ops, nxt, target) if bwd_ran
                                else (0.0, 0.0, 0.0))
        ranges = {"fwd_range": (f_lo, f_hi), "bwd_range": (b_lo, b_hi)}
    return {
        **ranges,
        "x": rounded(x_in.element_size() * x_in.numel(), unit),
        "saved": sum(v for k, v in saved.items() if k not in (kin, kout)),
        "keeps_input": kin in saved,
        "keeps_output": kout in saved,
        "fwd_mem": fwd_mem,
        "rec_mem": fwd_mem if compile else min(fwd_mem, rec_mem),
        "bwd_mem": bwd_mem,
        "grad": sum(rounded(p.numel() * p.element_size(), unit) for p in block.parameters()
                    if p.requires_grad),
        "fwd_time": fwd_time,
        "bwd_time": bwd_time,
        "fwd_flops": float(flops.get_total_flops()),
        "cast": casts.nbytes if casts else 0,
        "params": sum(rounded(p.numel() * p.element_size(), unit) for p in block.parameters()),
        "out": nxt,
    }


COMPILED_KEYS = ("saved", "keeps_input", "keeps_output", "fwd_mem", "rec_mem", "bwd_mem",
                 "fwd_time", "bwd_time")  # what compiling a block changes (FLOPs and shapes do not)


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Lift dynamo's per-code-object recompile limit while planning compiles many blocks and
    plans: they share code objects (`Sequential.forward`, `RematChain.forward`), and past the
    limit (8) dynamo silently runs eager, which would be profiled as if compiled."""
    with torch._dynamo.config.patch(recompile_limit=100_000,
                                    accumulated_recompile_limit=100_000):
        yield


def compiled(fn: Callable) -> Callable:
    """`torch.compile` with static shapes: a plan is made for one input shape."""
    return torch.compile(fn, dynamic=False)


def optimizer_memory(params: list[torch.Tensor], step: Step, unit: int = 1
                     ) -> tuple[int, int]:
    """Bytes of the step's optimizer state (and a GradScaler's) and the transient peak of its
    optimizer phase — unscaling, clipping and the update, as the user's step runs them —
    measured on tensors shaped like `params` on their device (meta costs nothing); (0, 0)
    without an optimizer."""
    trainable = [p for p in params if p.requires_grad]
    clones = [nn.Parameter(torch.zeros_like(p)) for p in trainable]
    for c in clones:
        c.grad = torch.zeros_like(c)
    opt = step.make_optimizer(clones)
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
