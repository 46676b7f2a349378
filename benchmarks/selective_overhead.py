"""The host cost of selective checkpointing's dispatch modes, per op, on this machine.

    .venv/bin/python benchmarks/selective_overhead.py [--repeats 30]

One GPT-2 layer at width 32 and 8 tokens (its 60-odd ops take microseconds each: the step is
host-bound, as a GPU's small kernels leave it) is trained one step four ways: plainly,
checkpointed whole, under torch's `create_selective_checkpoint_contexts` with a trivial
policy (save the matmuls), and under a rematlab op-level option saving the same ops
(`rematlab.remat.ops.run_option`). The difference from whole checkpointing, divided by the
forward's op count, is what each op costs in the forward's caching mode and the
recomputation's replay mode together: the price an op-level option pays per op, beside the
recomputation it saves. Medians of `repeats` steps after five warm-ups.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rematlab.core.dispatch import OpCall, OpRecorder
from rematlab.plans.plan import Selective
from rematlab.remat.ops import run_option
from rematlab.remat.recompute import RecomputeStats
from tests.realzoo import gpt2


class _Count:
    def __init__(self) -> None:
        self.ops = 0

    def on_op(self, call: OpCall) -> None:
        self.ops += call.func.namespace != "prim"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, _ = gpt2(batch=1, seq=8, layers=1, width=32)
    layer = model.transformer.h[0]
    x = torch.randn(1, 8, 32, requires_grad=True)
    count = _Count()
    with OpRecorder(count):
        layer(x)
    addmm = torch.ops.aten.addmm.default
    saves = tuple(("aten.addmm.default", k) for k in range(4))

    def policy(ctx, func, *a, **k):
        return CheckpointPolicy.MUST_SAVE if func == addmm else CheckpointPolicy.PREFER_RECOMPUTE

    item = Selective(0, "save addmm×4", saves, "")
    ways = {
        "plain": lambda: layer(x)[0].sum().backward(),
        "checkpointed whole": lambda: checkpoint(lambda t: layer(t)[0], x,
                                                 use_reentrant=False).sum().backward(),
        "torch selective (trivial policy)": lambda: checkpoint(
            lambda t: layer(t)[0], x, use_reentrant=False,
            context_fn=functools.partial(create_selective_checkpoint_contexts, policy)
        ).sum().backward(),
        "rematlab op-level option": lambda: run_option(
            item, layer, lambda t: layer(t)[0], RecomputeStats(), "layer", x).sum().backward(),
    }
    seconds = {}
    for name, work in ways.items():
        for _ in range(5):
            work()
        runs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            work()
            runs.append(time.perf_counter() - t0)
        seconds[name] = statistics.median(runs)
    whole = seconds["checkpointed whole"]
    print(f"{count.ops} ops per forward, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    for name, s in seconds.items():
        print(f"{name:34s} {s * 1e6:8.0f} µs/step   {(s - whole) / count.ops * 1e6:+6.1f} "
              "µs per op against checkpointing whole")


if __name__ == "__main__":
    main()
