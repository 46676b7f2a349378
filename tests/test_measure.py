import contextlib

import pytest
import torch
import torch.nn.functional as F

from rematlab import Spec, apply, measure, zoo
from rematlab.exceptions import ConfigError
from rematlab.probes import CpuAllocatorTrace, LiveTensorTracker, Span
from rematlab.steps import make_optimizer


class ConstantClock:
    """Every timed region lasts exactly `seconds`."""

    method = "constant"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def start(self) -> None:
        pass

    def stop(self) -> float:
        return self.seconds


class FakeMemory:
    """A memory probe that reports fixed bytes and counts how often it was used."""

    method = "fake"
    made = 0

    def __init__(self, device, cap) -> None:
        FakeMemory.made += 1
        self.peak, self.reserved = 4096, 8192
        self.phase_peaks = {"forward": 1024, "backward": 4096, "optimizer": 2048}
        self.tracked = 0

    def track(self, tensors) -> None:
        self.tracked += len(list(tensors))

    def phase(self, name):
        return contextlib.nullcontext()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def test_measure_reports_exact_figures_from_the_injected_clock_and_memory_probe():
    FakeMemory.made = 0
    obs = measure(Spec(model="mlp3", batch=8, repeats=3), clock=ConstantClock(0.002),
                  memory=FakeMemory)
    assert obs.outcome == "ok"
    # every phase of every step takes 2 ms: the probe step is 6 ms, so each repeat averages
    # ceil(0.05 / 0.006) = 9 steps
    assert obs.figures["steps_per_repeat"] == 9
    assert obs.times["forward"] == obs.times["backward"] == obs.times["optimizer"] == [0.002] * 3
    assert obs.times["step"] == [pytest.approx(0.006)] * 3
    assert obs.median("step") == pytest.approx(0.006) and obs.iqr("step") == 0.0
    assert obs.times["recompute"] == [0.0] * 3  # `none` recomputes nothing
    assert obs.measured_seconds == pytest.approx(3 * 0.006 * 9)
    assert obs.peaks == [4096] * 3 and obs.reserved == [8192] * 3
    assert obs.phase_peaks == {"forward": 1024, "backward": 4096, "optimizer": 2048}
    assert obs.methods["peak"] == "fake"
    assert FakeMemory.made == 2 + 3 + 1  # two warm-up steps, three repeats, the method name


def test_recomputation_is_timed_on_its_own_copy_of_the_injected_clock():
    obs = measure(Spec(model="mlp5", batch=8, strategy="uniform:2", repeats=2),
                  clock=ConstantClock(0.002), memory=FakeMemory)
    assert obs.outcome == "ok"
    assert obs.times["recompute"] == [0.002] * 2  # one recomputed segment per step


def test_tracker_counts_known_allocations_exactly():
    t = LiveTensorTracker()
    with t:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 B
        b = torch.empty(500, dtype=torch.float64)  # 4000 B
        view = a[:10]  # shares a's storage: no new bytes
        del a
        assert t.live == 8000
        del view
        assert t.live == 4000
        c = torch.empty(250, dtype=torch.float32)
    assert t.peak == 8000 and t.live == 5000
    del b, c
    assert t.live == 0


def test_tracker_rounds_to_the_allocator_block_size():
    t = LiveTensorTracker(unit=512)
    with t:
        a = torch.empty(3, dtype=torch.uint8)
        b = torch.empty(513, dtype=torch.uint8)
    assert t.live == 512 + 1024
    del a, b
    assert t.live == 0


@pytest.mark.parametrize("strategy", ["none", "sqrt", "uniform:2"])
def test_tracker_peak_matches_torch_memtracker(strategy):
    from torch.distributed._tools.mem_tracker import MemTracker

    model = zoo.mlp(5, width=256)
    remat = apply(model, strategy)
    opt = make_optimizer("momentum", model.parameters())
    x, y = torch.randn(512, 1, 28, 28), torch.randint(0, 10, (512,))

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(remat(x), y).backward()
        opt.step()

    step()
    step()
    mt = MemTracker()
    mt.track_external(model, opt, x, y)
    with mt:
        step()
    independent = max(v["Total"] for v in mt.get_tracker_snapshot("peak").values())
    ours = LiveTensorTracker()
    opt.zero_grad(set_to_none=True)
    ours.track([*model.parameters(), *(t for s in opt.state.values() for t in s.values()), x, y])
    with ours:
        step()
    assert ours.peak == independent


def test_measure_observes_memory_saved_by_checkpointing():
    none = measure(Spec(model="mlp7", batch=2048, repeats=1))
    sqrt = measure(Spec(model="mlp7", batch=2048, strategy="sqrt", repeats=1))
    assert none.outcome == sqrt.outcome == "ok"
    assert sqrt.figures["saved_activation_bytes"] < none.figures["saved_activation_bytes"]
    assert sqrt.figures["recompute_flops"] > 0 == none.figures["recompute_flops"]
    assert sqrt.figures["backward_flops"] > none.figures["backward_flops"]
    assert sqrt.peak < none.peak
    assert none.figures["forward_flops"] == sqrt.figures["forward_flops"]


def test_saved_bytes_exclude_parameters_and_input():
    obs = measure(Spec(model="mlp3", batch=4, repeats=1))
    # mlp3, width 1024: saved are the 2 hidden ReLU outputs and the logits path — far less
    # than the 3.3 MB of weights that Linear also saves for backward.
    assert obs.figures["saved_activation_bytes"] < 4 * (2 * 4 * 1024) * 4
    assert obs.figures["param_bytes"] == 4 * obs.figures["params"]
    assert obs.figures["optimizer_state_bytes"] == obs.figures["param_bytes"]  # momentum


def test_memory_cap_turns_into_an_oom_outcome():
    obs = measure(Spec(model="mlp3", batch=64, repeats=1, max_memory=1 << 20))
    assert obs.outcome == "oom" and "cap" in obs.error
    assert obs.peaks == [] and obs.rows()[0]["outcome"] == "oom"


def test_rows_are_one_per_repeat_and_carry_methods_and_environment():
    obs = measure(Spec(model="lenet5", batch=4, repeats=3, strategy="uniform:2"))
    rows = obs.rows()
    assert [r["repeat"] for r in rows] == [0, 1, 2]
    assert all(r["peak_bytes"] == obs.peaks[i] for i, r in enumerate(rows))
    for key in ("method_time", "method_peak", "vendor", "torch_version", "device_name",
                "threads", "host", "timestamp", "rematlab_version"):
        assert rows[0][key] not in (None, ""), key
    assert rows[0]["vendor"] == "CPU"


@pytest.mark.parametrize("kwargs", [{"batch": 0}, {"batch": -3}, {"strategy": "uniform:0"},
                                    {"device": "tpu"}, {"model": "resnet9"},
                                    {"optimizer": "lion"}, {"warmup": 1}, {"dtype": "int8"}])
def test_bad_specs_raise_config_errors(kwargs):
    spec = {"model": "mlp3", "batch": 4, **kwargs}
    with pytest.raises(ConfigError):
        measure(Spec(**spec))


def test_cuda_request_without_cuda_is_a_config_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="not available"):
        measure(Spec(model="mlp3", batch=4, device="cuda"))


def test_nested_recomputation_flops_count_each_recomputed_forward(tmp_path):
    from torch.utils.flop_counter import FlopCounterMode

    from rematlab.plans import Plan, Segment

    plan = Plan(7, (Segment(0, 4, (Segment(0, 2, (0, 1)), 2, 3)), 4, 5, 6))
    path = tmp_path / "nested.json"
    path.write_text(plan.to_json())
    obs = measure(Spec(model="mlp7", batch=16, strategy=f"plan:{path}", repeats=1))
    model = zoo.mlp(7)
    x = torch.randn(16, 1, 28, 28)
    per_block = []
    for block in model:
        counter = FlopCounterMode(display=False)
        with counter:
            x = block(x)
        per_block.append(counter.get_total_flops())
    # the outer segment is recomputed once; inside it, the inner segment once more
    assert obs.figures["recompute_flops"] == sum(per_block[0:4]) + sum(per_block[0:2])


def test_allocator_trace_counts_every_allocation_and_free_per_phase():
    with CpuAllocatorTrace() as trace:
        with trace.phase("one"):
            a = torch.empty(1000, 1000)  # 4 MB, kept
            b = torch.empty(500, 1000)  # 2 MB, freed inside the phase
            del b
        with trace.phase("two"):
            c = torch.empty(2000, 1000)  # 8 MB on top of a
            del c, a
    assert trace.phases["one"] == Span(start=0, peak=6_000_000)
    assert trace.phases["two"] == Span(start=4_000_000, peak=12_000_000)
    assert trace.peak == 12_000_000


def test_allocator_trace_sees_inside_compiled_code():
    fn = torch.compile(lambda t: (t * 2).sin() + 1)
    x = torch.randn(1000, 1000)
    fn(x)
    with CpuAllocatorTrace() as trace:
        out = fn(x)
    assert trace.peak >= out.numel() * out.element_size()
