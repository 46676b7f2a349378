"""The GPU calibration's arithmetic, with a fake clock on the meta device (issue 40): no GPU is
here, and none is needed to check what is timed and how rates are made of it."""

import pytest
import torch

from rematlab.core.dispatch import OpCall, OpRecorder
from rematlab.preflight.gpu_calibrate import GEMMS, measure_gpu
from rematlab.preflight.targets import Target

PEAK = 500e12  # FLOP/s the fake device reaches on a GEMM
BANDWIDTH = 2e12
LAUNCH = 4e-6


class FakeClock:
    """`Timing` on the meta device: each timed call's seconds from what it launched, which a
    dispatch-free meta run cannot tell, so the calibration's own callers are recognised by
    the work they were given."""

    method = "fake clock"

    def __init__(self, slow: tuple[int, int, int] | None = None) -> None:
        self.sizes: list[tuple] = []
        self.slow = slow  # a GEMM shape that reaches half the peak

    def seconds(self, fn) -> float:
        ops: list = []

        class Watch:
            def on_op(self, call: OpCall) -> None:
                ops.append((call.func, [tuple(a.shape) for a in call.args
                                        if isinstance(a, torch.Tensor)]))
        with OpRecorder(Watch()):
            fn()
        total = 0.0
        for func, shapes in ops:
            self.sizes.append(tuple(shapes))
            if func is torch.ops.aten.mm.default:
                (m, k), (_, n) = shapes
                total += 2 * m * k * n / (PEAK / 2 if (m, k, n) == self.slow else PEAK)
            elif func is torch.ops.aten.copy_.default:
                total += 2 * 4 * shapes[0][0] / BANDWIDTH
            else:
                total += LAUNCH
        return total


def test_rates_come_from_events_timed_gemms_copies_and_tiny_kernels():
    clock = FakeClock()
    fields = measure_gpu(torch.device("meta"), clock, memory=79 * 2 ** 30, small_ops=100)
    assert fields["flops"] == pytest.approx(
        {"float32": PEAK, "bfloat16": PEAK, "float16": PEAK})
    assert fields["bandwidth"] == pytest.approx(BANDWIDTH)
    assert fields["overhead"] == pytest.approx((LAUNCH / 2, LAUNCH, 2 * LAUNCH))
    assert fields["memory"] == 79 * 2 ** 30  # as torch reports the card, not its data sheet
    assert fields["efficiency"] == pytest.approx((1.0, 1.0, 1.0))  # one rate for all shapes
    Target(**fields)  # a valid profile
    gemms = {s for s in clock.sizes if len(s) == 2 and len(s[0]) == 2 and len(s[1]) == 2}
    assert {((m, k), (k, n)) for m, k, n in GEMMS} <= gemms  # real layers' sizes
    assert min(min(a + b) for a, b in gemms) >= 4096


def test_a_slower_shape_widens_the_efficiency_interval():
    slow = measure_gpu(torch.device("meta"), FakeClock(slow=GEMMS[2]), memory=1, small_ops=10)
    assert slow["flops"]["bfloat16"] == pytest.approx(PEAK)  # the median of three shapes
    assert slow["efficiency"] == pytest.approx((0.5, 1.0, 1.0))
