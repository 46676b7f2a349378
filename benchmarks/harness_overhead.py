"""Where a configuration's time goes outside its timed repeats (issue 51): one `measure` per
configuration, in process (no worker, no database), with each stage of the protocol timed.

    .venv/bin/python benchmarks/harness_overhead.py

Stages (`rematlab.measurement.measure`): building the model and batch (`_Setup.build`), the
count of FLOPs and saved bytes (`_counted`: on the configuration's fake twin, once per shape),
the optimizer's state (`_optimizer_state`: a zero-gradient update at rate 0), the tracked step
(`_Tracked`: the step's peak, the first real step), and the timer (warm-up left over, the
guard's calibration kernel, the repeats). `measured` is what the study calls measured: the
timed repeats alone. Run it on a quiet machine: the guard waits for quiet otherwise, and the
timer's share then includes it.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rematlab.core import timer as timer_module
from rematlab.measurement import measure as protocol
from rematlab.measurement.spec import Spec

CONFIGS = [("mlp3", 256, None), ("alexnet", 64, "cifar"), ("vgg16", 32, "cifar"),
           ("vgg16", 128, "cifar")]


def _timing(spent: dict[str, float], owner: object, name: str, label: str) -> None:
    """`owner.name` wrapped so that its seconds add up under `label` in `spent`."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args: object, **kwargs: object) -> object:
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0
    setattr(owner, name, timed)


def main() -> None:
    spent: dict[str, float] = {}
    _timing(spent, protocol._Setup, "build", "setup")
    _timing(spent, protocol, "_counted", "count")
    _timing(spent, protocol, "_optimizer_state", "state")
    _timing(spent, protocol._Tracked, "run", "tracked step")
    _timing(spent, timer_module.Timer, "run", "timer")
    stages = ("setup", "count", "state", "tracked step", "timer")
    print(f"| configuration | wall | measured | outside the repeats | {' | '.join(stages)} |")
    print("|---|---|---|---|" + "---|" * len(stages))
    for model, batch, scale in CONFIGS:
        for strategy in ("none", "sqrt"):
            spent.clear()
            t0 = time.perf_counter()
            obs = protocol.measure(Spec(model=model, batch=batch, input=scale,
                                        strategy=strategy, warmup=1, repeats=3, threads=2))
            wall = time.perf_counter() - t0
            cells = " | ".join(f"{spent.get(k, 0.0):.2f} s" for k in stages)
            print(f"| {model} b{batch} {strategy} | {wall:.2f} s | {obs.measured_seconds:.2f} s "
                  f"| {1 - obs.measured_seconds / wall:.0%} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
