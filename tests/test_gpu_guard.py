"""The interference guard on a GPU (issue 51), on faked card readings: what disturbs a step
on a card is another process there, clocks slowed by heat or the hardware, or a launch thread
starved of a CPU, not the load of the host's other cores. The CPU's rule is unchanged
(`tests/test_measure.py`)."""

import time

import pytest
import torch

from rematlab.core.guard import RULES, Guard, Sample

CUDA = torch.device("cuda", 0)  # never initialised: the readings are fakes


class FakeCard:
    """A card as `core.card.CardReadings` reads one, scripted per reading: processes
    computing on it (us included), bytes others hold, a slowdown, and the launch thread's
    wait as a share of wall time."""

    def __init__(self, processes=(1,), others=(0,), slowdown=(None,), starved=0.0):
        self._processes, self._others = list(processes), list(others)
        self._slowdown = list(slowdown)
        self.starved = starved

    @staticmethod
    def _next(values: list):
        return values.pop(0) if len(values) > 1 else values[0]

    def processes(self):
        return self._next(self._processes)

    def others_bytes(self):
        return self._next(self._others)

    def slowdown(self):
        return self._next(self._slowdown)

    def launch_wait(self):
        return time.perf_counter() * self.starved


def _run(card: FakeCard, repeats: int = 3):
    waits = []
    guard = Guard(card=lambda device: card, sleep=waits.append, reference=0.01)

    def repeat():
        time.sleep(0.002)  # some wall time for the launch thread's share
        return Sample(times={"step": 1.0}, steps=1, calibration=0.01, measured_s=1.0)
    _, measured, evidence = guard.run(repeat, repeats, key=("gpu-guard",), device=CUDA)
    return measured, evidence, waits


def test_an_idle_card_is_trusted_under_the_gpu_rule():
    measured, evidence, waits = _run(FakeCard())
    assert evidence.trusted and evidence.reason is None
    assert len(measured) == 3 and waits == []  # nothing measured again, nothing waited
    assert evidence.rule == "gpu"
    assert evidence.columns()["method_guard"] == RULES["gpu"]


def test_a_second_process_on_the_card_is_untrusted_with_the_reason():
    measured, evidence, waits = _run(FakeCard(processes=(2,)))
    assert not evidence.trusted
    assert evidence.reason == "1 other process(es) on the card"
    assert evidence.columns()["guard_reason"] == evidence.reason
    assert len(measured) == 3 + 6 and waits  # re-measured within the budget, after waiting


def test_a_process_that_leaves_costs_one_repeat_measured_again():
    # on the card during the first repeat and the first window watched, then gone
    measured, evidence, _ = _run(FakeCard(processes=(2, 2, 1)))
    assert evidence.trusted and len(measured) == 4


@pytest.mark.parametrize(("card", "reason"), [
    (FakeCard(processes=(None,), others=(2 << 30,)), "2048 MiB held on the card by others"),
    (FakeCard(slowdown=("hardware thermal slowdown",)),
     "clocks slowed: hardware thermal slowdown"),
    (FakeCard(starved=0.5), "the launch thread waited"),
])
def test_other_memory_slowed_clocks_and_a_starved_launch_thread_are_untrusted(card, reason):
    _, evidence, _ = _run(card)
    assert not evidence.trusted and evidence.reason.startswith(reason), evidence.reason


def test_without_nvml_a_card_alone_is_trusted_on_its_memory():
    _, evidence, _ = _run(FakeCard(processes=(None,), others=(0,)))
    assert evidence.trusted


def test_a_cpu_device_keeps_the_cpu_rule():
    from tests.test_measure import QuietHost

    guard = Guard(host=QuietHost(loads=[0.6]), sleep=lambda s: None, reference=0.01,
                  card=lambda device: pytest.fail("a CPU step reads no card"))
    _, _, evidence = guard.run(
        lambda: Sample(times={"step": 1.0}, steps=1, calibration=0.01, measured_s=1.0), 3,
        key=("cpu-guard",), device=torch.device("cpu"))
    assert evidence.rule == "cpu" and not evidence.trusted
    assert evidence.reason == "other processes took 60% of this process's CPUs"
