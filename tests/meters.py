"""An independent meter for budgets: torch's own MemTracker around the user's loop."""

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from rematlab.core.batch import call, tensors
from rematlab.core.optimizers import make_optimizer
from rematlab.core.steps import default_loss


def own_loop_peak(model, batch, meter: str = "memtracker") -> int:
    """The peak of the user's own loop, by torch's MemTracker (an independent meter), or by
    the live-storage tracker (`meter="live"`) for models with frozen parameters, which
    MemTracker refuses: two warm-up steps (optimizer state), then one tracked step, the
    output alive until the end."""
    opt = make_optimizer("momentum", model.parameters())

    def step():
        opt.zero_grad(set_to_none=True)
        out = call(model, batch)
        default_loss(out, batch).backward()
        opt.step()
        return out

    step()
    step()
    opt.zero_grad(set_to_none=True)
    if meter == "live":
        return _live_peak(model, batch, opt, step)
    mt = MemTracker()
    mt.track_external(model, opt, *tensors(batch))
    with mt:
        del_me = step()
        del del_me
    return max(v["Total"] for v in mt.get_tracker_snapshot("peak").values())


def user_loop_peak(model, batch, *, precision=None, micro_batches=1, clip=None,
                   optimizer=None, meter="memtracker") -> int:
    """The peak of a hand-written loop as users run it, with torch's own APIs (not
    rematlab's): `torch.autocast` around forward and loss (bf16 or fp16 with a real
    `torch.amp.GradScaler`), `micro_batches` forwards per optimizer step with the loss
    divided, `clip_grad_norm_`, then the optimizer (AdamW by default). Two warm-up steps
    make the optimizer state; the third is measured by torch's MemTracker, or, for several
    forwards per step (which MemTracker refuses), by the live-storage tracker. `batch` is
    one micro-batch, run `micro_batches` times, or a list of micro-batches, each its own
    tensors, as a data loader yields them."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[precision]
    opt = optimizer(model.parameters()) if optimizer else torch.optim.AdamW(
        model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    batches = batch if isinstance(batch, list) else [batch] * micro_batches

    def step():
        opt.zero_grad(set_to_none=True)
        for mb in batches:
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                out = call(model, mb)
                loss = default_loss(out, mb) / len(batches)
            (scaler.scale(loss) if scaler else loss).backward()
            del out, loss
        if scaler:
            scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()

    step()
    step()
    opt.zero_grad(set_to_none=True)
    if meter == "memtracker":
        mt = MemTracker()
        mt.track_external(model, opt, *tensors(batch))
        with mt:
            step()
        return max(v["Total"] for v in mt.get_tracker_snapshot("peak").values())
    return _live_peak(model, batch, opt, step)


def _live_peak(model, batch, opt, step) -> int:
    """The peak of `step()` by the live-storage tracker, with the model's parameters and
    buffers, the batch and `opt`'s state alive before it."""
    from rematlab.core.probes import LiveTensorTracker

    tracker = LiveTensorTracker()
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    tracker.track([*model.parameters(), *model.buffers(), *tensors(batch), *state])
    with tracker:
        step()
    return tracker.peak


def loss_loop_peak(model, batch, loss_of) -> int:
    """The peak of a loop whose forward returns the loss alone (`loss_of()`, under bf16
    autocast: a step function, or HF Trainer's `compute_loss`, which drops the output before
    backward), with momentum SGD; two warm-up steps, the third measured by the live-storage
    tracker."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of()
        loss.backward()
        del loss
        opt.step()

    step()
    step()
    return _live_peak(model, batch, opt, step)


def saved_step(model, run, x) -> tuple[list[torch.Tensor], int]:
    """Gradients of a cross-entropy step through `run` on `x` (ten classes), and the bytes
    autograd saved for it (compiled graphs save through the hooks too)."""
    model.zero_grad(set_to_none=True)
    sizes = []

    def pack(t):
        sizes.append(t.untyped_storage().nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.nn.functional.cross_entropy(run(x), torch.arange(len(x)) % 10).backward()
    return [p.grad.clone() for p in model.parameters()], sum(sizes)


def compiled_alone(model):
    """`model` compiled with dynamo's caches reset: its own graph, never one dynamo traced
    for a planned copy before, and never past the recompile limit (a forward there would
    silently run eager)."""
    torch._dynamo.reset()
    return torch.compile(model, dynamic=False)
