"""Host seconds of torch.utils.checkpoint's own work per region: a one-layer region's
checkpointed step, less its plain step and its forward run again (what the recomputation
itself costs), at sizes where the kernels take next to nothing, so what is left is the host's
(saved-tensor hooks, the RNG state stashed and restored, the frames of the recomputation).
The figure a data-sheet GPU target assumes (`rematlab.preflight.targets.HOST_CHECKPOINT`).

Side by side in one run, each of the three timed in interleaved rounds; the median and the
quartiles of the rounds' differences are reported, and foreign load on the machine is said.

    .venv/bin/python benchmarks/checkpoint_host.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from rematlab.core.timer import watched

ROUNDS, CALLS = 15, 200


def _seconds(fn: Callable[[], object]) -> float:
    """Median seconds of `CALLS` calls of `fn`."""
    times = []
    for _ in range(CALLS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    x = torch.randn(8, requires_grad=True)
    plain = lambda: layer(x).sum().backward()  # noqa: E731
    kept = lambda: checkpoint(layer, x, use_reentrant=False).sum().backward()  # noqa: E731
    forward = lambda: layer(x)  # noqa: E731
    extra = []
    with watched("the checkpoint host-cost rounds"):
        for fn in (plain, kept, forward):  # warm-up
            _seconds(fn)
        for _ in range(ROUNDS):
            p, k, f = _seconds(plain), _seconds(kept), _seconds(forward)
            extra.append(k - p - f)
    q1, mid, q3 = statistics.quantiles(extra, n=4)
    print(f"checkpoint host work per region: median {mid * 1e6:.0f} us, quartiles "
          f"{q1 * 1e6:.0f}-{q3 * 1e6:.0f} us over {ROUNDS} rounds of {CALLS} calls "
          f"(torch {torch.__version__}, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
