"""An independent meter for budgets: torch's own MemTracker around the user's loop."""

from torch.distributed._tools.mem_tracker import MemTracker

from rematlab.core.batch import call, tensors
from rematlab.core.optimizers import make_optimizer
from rematlab.core.steps import default_loss


def own_loop_peak(model, batch) -> int:
    """The peak of the user's own loop, by torch's MemTracker (an independent meter): two
    warm-up steps (optimizer state), then one tracked step, the output alive until the end."""
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
    mt = MemTracker()
    mt.track_external(model, opt, *tensors(batch))
    with mt:
        del_me = step()
        del del_me
    return max(v["Total"] for v in mt.get_tracker_snapshot("peak").values())
